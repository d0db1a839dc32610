"""The warm-started tiny models shipped with yatt-apps (`yatt_apps.runtime.shipped`): they are the ones the
default presets ask for (their key is computed from the current spec, tokenizer corpus and warm-start recipe,
so a changed recipe without `python -m yatt_apps.runtime.shipped` fails here), a run copies them instead of
training, and the project's own warm start reproduces them: from a fresh tokenizer and model, its first steps
give the losses recorded when they were made."""

from __future__ import annotations

import json

import pytest
from yatt_apps.config import tiny_cpu
from yatt_apps.io.models import load_tokenizer, prepare_model, tiny_text_model
from yatt_apps.runtime import shipped
from yatt_apps.runtime.launch import tiny_corpus
from yatt_apps.runtime.warmstart import extra_corpus, extra_tokens, warm_start

KINDS = ("policy", "genrm")
STEPS = 12  # the first steps retrained: seconds, and the losses still fall steeply there


def _spec_and_corpus(kind: str):
    cfg = tiny_cpu()
    spec = cfg.model if kind == "policy" else cfg.judge
    assert spec is not None and spec.warm_start == kind
    return spec, tiny_corpus(cfg) + extra_corpus(spec)


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_presets_warm_started_models_are_shipped(kind):
    spec, corpus = _spec_and_corpus(kind)
    folder = shipped.find(spec, corpus)
    assert folder is not None, (
        f"no shipped {kind} for the current recipe: run python -m yatt_apps.runtime.shipped"
    )
    report = json.loads((folder / "warm_start.json").read_text())
    assert (report["kind"], report["steps"], len(report["losses"])) == (
        kind,
        spec.warm_start_steps,
        spec.warm_start_steps,
    )
    assert report["losses"][-1] < report["losses"][0] / 4  # it learned


@pytest.mark.parametrize("kind", KINDS)
def test_retraining_reproduces_the_shipped_warm_start(kind):
    spec, corpus = _spec_and_corpus(kind)
    folder = shipped.find(spec, corpus)
    assert folder is not None
    model, tok = tiny_text_model(spec, corpus, extra_tokens(spec))
    assert tok.get_vocab() == load_tokenizer(str(folder)).get_vocab()  # the same trained tokenizer
    report = warm_start(spec, model, tok, stop=STEPS)
    recorded = json.loads((folder / "warm_start.json").read_text())["losses"][:STEPS]
    assert report["losses"] == pytest.approx(recorded, rel=1e-3)


def test_a_run_copies_the_shipped_model_instead_of_training(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_cpu()
    out = prepare_model(cfg.model, tmp_path / "policy", tiny_corpus(cfg))
    folder = shipped.find(*_spec_and_corpus("policy"))
    assert folder is not None
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) and not any(
        p.name.startswith(".") or ".tmp" in p.name for p in (tmp_path / "cache").iterdir()
    )
