"""Warm-started tiny models: the judge's training prompts are exactly the GenRM's and GenPRM's, the cache is
keyed by the spec and reused, and (slow) the warm-started policy and judge do what the default run needs."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from yatt_apps.config import ModelSpec
from yatt_apps.io.data import PromptRow, arithmetic_task
from yatt_apps.io.models import (
    load_causal_lm,
    load_tokenizer,
    prepare_model,
    tiny_text_model,
    tokenizer_corpus,
)
from yatt_apps.runtime import warmstart
from yatt_multimodal.math_answers import verify_math
from yatt_multimodal.types import RewardRequest

CORPUS = tokenizer_corpus(arithmetic_task(64, seed=0))


@pytest.fixture(scope="module")
def judge_tok():
    spec = ModelSpec(warm_start="genrm", warm_start_steps=1)
    return tiny_text_model(spec, CORPUS + warmstart.extra_corpus(spec))[1]


def test_judge_examples_are_the_genrm_prompt(judge_tok):
    from yatt_apps.config import TINY_JUDGE
    from yatt_multimodal.genrm import GenRMJudge
    from yatt_multimodal.prompt_codecs import HFChatCodec

    rows = [PromptRow(prompt="3 + 4 =", answer="7")] * 12
    examples = warmstart.judge_examples(judge_tok, rows, random.Random(0))
    judge = GenRMJudge(engine=None, codec=HFChatCodec(judge_tok), spec=TINY_JUDGE)
    assert (TINY_JUDGE.template_name, TINY_JUDGE.template_version) == ("verify_yes_no", 2)
    for (prompt, verdict), candidate in zip(examples, _candidates(rows, 0), strict=True):
        request = RewardRequest(request_id="r", prompt="3 + 4 =", response=candidate, reference="7")
        assert prompt == judge.build_prompt(request).token_ids
        right = bool(candidate.strip()) and verify_math(candidate, "7")  # the rule the judge must agree with
        assert judge_tok.decode(verdict, skip_special_tokens=True) == f"Verdict: {'Yes' if right else 'No'}"


def test_critic_examples_are_the_genprm_prompt(judge_tok):
    from yatt_apps.config import TINY_CRITIC, tiny_cpu_capo
    from yatt_multimodal.genprm import GenPRM, split_steps
    from yatt_multimodal.prompt_codecs import HFChatCodec

    assert tiny_cpu_capo().capo.critic == TINY_CRITIC
    rows = [PromptRow(prompt="9 - 4 =", answer="5")] * 6
    examples = warmstart.critic_examples(judge_tok, rows, random.Random(1))
    prm = GenPRM(None, HFChatCodec(judge_tok), TINY_CRITIC, tokenizer=judge_tok)
    candidates = [c for c in _candidates(rows, 1) if split_steps(c)]
    for (prompt, target), candidate in zip(examples, candidates, strict=True):
        request = RewardRequest(request_id="r", prompt="9 - 4 =", response=candidate, reference="5")
        assert prompt == prm._prompt(request, split_steps(candidate)).token_ids
        right = candidate == "5"
        assert (
            judge_tok.decode(target, skip_special_tokens=True) == f"Wrong steps: {'none' if right else '1'}"
        )


def _candidates(rows, seed):
    rng = random.Random(seed)
    return [warmstart.near_miss(rng, row) for row in rows]


def test_near_misses_are_labelled_by_math_verify():
    assert warmstart.is_correct("7", "7") and not warmstart.is_correct("8", "7")
    assert not warmstart.is_correct("-", "7") and not warmstart.is_correct("", "7")
    assert warmstart.is_correct("-3", "-3") and not warmstart.is_correct("3", "-3")
    rng = random.Random(0)
    kinds = [warmstart.near_miss(rng, PromptRow(prompt="12 + 5 =", answer="17")) for _ in range(400)]
    right = sum(k == "17" for k in kinds) / len(kinds)
    assert 0.3 < right < 0.5  # about 40% right; the rest close to right or malformed
    assert {"16", "18", "7"} <= set(kinds)


def test_cache_is_keyed_by_the_spec_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path / "cache"))
    spec = ModelSpec(warm_start="policy", warm_start_steps=3, warm_start_batch_size=4)
    key = warmstart.cache_key(spec, CORPUS)
    assert key == warmstart.cache_key(msgspec.structs.replace(spec), CORPUS)
    assert key != warmstart.cache_key(msgspec.structs.replace(spec, warm_start_steps=4), CORPUS)
    assert key != warmstart.cache_key(spec, CORPUS[1:])
    assert key != warmstart.cache_key(msgspec.structs.replace(spec, hidden_size=32), CORPUS)
    serving = msgspec.structs.replace(
        spec, tensor_parallel=2, pipeline_parallel=2, engine="vllm", dtype="fp32"
    )
    assert key == warmstart.cache_key(serving, CORPUS)  # how a model is served does not change its weights
    first = prepare_model(spec, tmp_path / "a" / "policy", CORPUS)
    report = msgspec.json.decode((first / "warm_start.json").read_bytes())
    assert report["kind"] == "policy" and report["steps"] == 3
    (cached,) = (tmp_path / "cache").iterdir()
    assert cached.name == f"policy-{key}"
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    second = prepare_model(spec, tmp_path / "b" / "policy", CORPUS)  # from the cache: not trained again
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert not list((tmp_path / "cache").glob("*.tmp*")) and not (tmp_path / "b" / "policy.tmp").exists()


def test_bad_warm_start_specs():
    with pytest.raises(ValueError, match=r"warm-starts a tiny text model: it needs model\.path empty"):
        ModelSpec(path="/models/x", warm_start="policy", warm_start_steps=10)
    with pytest.raises(ValueError, match="warm_start_steps must be >= 0"):
        ModelSpec(warm_start_steps=-1)


@pytest.fixture(scope="module")
def preset_models(tmp_path_factory):
    """The default run's warm-started policy and judge, built as `yatt grpo` builds them (the same tokenizer
    corpus: a judge trained with another tokenizer is another judge), from the shared cache that every tiny
    job of the suite uses (built here, or by whichever job ran first: the same key, the same bytes)."""
    from types import SimpleNamespace

    from yatt_apps.config import tiny_cpu
    from yatt_apps.runtime.launch import prepare_models

    tmp = tmp_path_factory.mktemp("warm")
    cfg = tiny_cpu()
    policy, judge = prepare_models(cfg, SimpleNamespace(path=tmp))
    return cfg, Path(policy), Path(judge)


@pytest.mark.slow
def test_warm_policy_answers_some_validation_prompts(preset_models):
    """Greedy accuracy on the default run's validation rows: above zero, with headroom for RL."""
    import torch
    from yatt_apps.runtime.launch import val_rows

    cfg, policy, _ = preset_models
    model, tok = load_causal_lm(policy), load_tokenizer(policy)
    rows = val_rows(cfg)
    right = 0
    for row in rows:
        ids = torch.tensor([warmstart.policy_examples(tok, [row])[0][0]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        right += warmstart.is_correct(text, row.answer)
    assert 0.1 <= right / len(rows) <= 0.6, right


@pytest.mark.slow
def test_warm_judge_states_the_verdict_phrase(preset_models):
    """The judge's warm-start loss (verdict tokens, and its prompts at weight 0.2) fell at least tenfold."""
    report = msgspec.json.decode((preset_models[2] / "warm_start.json").read_bytes())
    assert report["kind"] == "genrm" and report["last_loss"] < 0.1 * report["first_loss"], report


@pytest.mark.slow
def test_warm_judge_agrees_with_math_verify(preset_models):
    """Greedy verdicts on 128 held-out (problem, candidate) prompts agree with math_verify at least 0.8 of the
    time (0.38 of them are right: always "No" would score 0.62). Measured 0.98 with verify_yes_no v2 (800
    steps); with v1, whose solution sits before the instruction, about 0.56 (always "No")."""
    report = msgspec.json.decode((preset_models[2] / "warm_start.json").read_bytes())
    assert report["held_out_accuracy"] >= 0.8, report
