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


AGENT_STEPS = 6  # the agent warm start's first steps retrained (batches of 32 conversations: seconds)


def test_the_agent_presets_warm_start_is_shipped_and_reproduced():
    """`tiny_cpu_agent`'s multi-turn SFT warm start is shipped under the current recipe's key (a changed
    recipe without `python -m yatt_apps.runtime.shipped agent` fails here), and a fresh tokenizer and model
    trained by the project's own code give its first recorded losses."""
    from yatt_apps.config import tiny_cpu_agent
    from yatt_apps.runtime import agent_warmstart
    from yatt_apps.runtime.agent import resolve_env
    from yatt_rollout.env import ENVIRONMENTS

    cfg = tiny_cpu_agent()
    folder = shipped.find_agent(cfg)
    assert folder is not None, "no shipped agent warm start: run python -m yatt_apps.runtime.shipped agent"
    report = json.loads((folder / "warm_start.json").read_text())
    assert (report["kind"], report["ship_key"], report["steps"], len(report["losses"])) == (
        "agent",
        agent_warmstart.ship_key(cfg),
        cfg.rollout.sft_steps,
        cfg.rollout.sft_steps,
    )
    assert report["losses"][-1] < report["losses"][0] / 4  # it learned
    model, tok, examples = agent_warmstart.fresh(cfg, ENVIRONMENTS[resolve_env(cfg.rollout.env)])
    assert tok.get_vocab() == load_tokenizer(str(folder)).get_vocab()  # the same trained tokenizer
    losses = agent_warmstart.sft(model, examples, tok.pad_token_id, cfg, stop=AGENT_STEPS)
    assert losses == pytest.approx(report["losses"][:AGENT_STEPS], rel=1e-3)


def test_an_agent_run_copies_the_shipped_warm_start(tmp_path, monkeypatch, capsys):
    """`agent_warmstart.warm_started` with an empty cache copies the shipped folder (no training, no
    warm-starting message) into the cache under its versioned key."""
    from yatt_apps.config import tiny_cpu_agent
    from yatt_apps.runtime import agent_warmstart
    from yatt_apps.runtime.agent import resolve_env
    from yatt_rollout.env import ENVIRONMENTS

    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("YATT_NO_SHIPPED", raising=False)
    cfg = tiny_cpu_agent()
    path = agent_warmstart.warm_started(cfg, ENVIRONMENTS[resolve_env(cfg.rollout.env)])
    folder = shipped.find_agent(cfg)
    assert folder is not None and path == tmp_path / "cache" / f"agent-{agent_warmstart.cache_key(cfg)}"
    assert (path / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert "warm-starting" not in capsys.readouterr().err
