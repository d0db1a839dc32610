"""HFEngine on a tiny Qwen2 built from a config: parity with `model.generate` and a fresh forward, sampling
controls, bad requests, batching, weight updates and sleep. One model and engine for the module."""

import asyncio

import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from yatt_rollout.buckets import make_buckets  # noqa: E402
from yatt_rollout.hf_engine import HFEngine  # noqa: E402
from yatt_rollout.tiny import tiny_causal_lm, train_tokenizer  # noqa: E402
from yatt_rollout.types import GenerateRequest, Generator, Prompt, SamplingParams  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    return tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def engine(model, tok):
    eng = HFEngine(model, tok, max_batch_size=16)
    yield eng
    eng.close()


def _req(rid, ids, **sampling):
    return GenerateRequest(request_id=rid, prompt=Prompt(token_ids=ids), sampling=SamplingParams(**sampling))


def _forward_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_engine_is_a_generator(engine):
    assert isinstance(engine, Generator)


def test_greedy_matches_generate_and_logprobs_match_a_fresh_forward(engine, model, tok):
    prompts = [tok.encode(t) for t in ["12 + 7 =", "3", "25 + 25 = 50, 1 + 1 ="]]  # lengths differ: left pad
    out = engine.generate([_req(f"p{i}", p, temperature=0, max_new_tokens=10) for i, p in enumerate(prompts)])
    assert [c.request_id for c in out] == ["p0", "p1", "p2"]
    for prompt, c in zip(prompts, out, strict=True):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id
        )
        assert c.token_ids == ref[0, len(prompt) :].tolist()
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _forward_logprobs(model, prompt, c.token_ids), atol=1e-5, rtol=0
        )
        assert c.finish_reason == "length" and c.policy_version == 0


def test_sampled_logprobs_match_a_fresh_forward(engine, model, tok):
    prompt = tok.encode("7 + 8 =")
    out = engine.generate(
        [_req("s", prompt, n=3, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=12, seed=1)]
    )
    assert [c.index for c in out] == [0, 1, 2]
    for c in out:  # 12 tokens, or fewer ending in eos
        assert (len(c.token_ids), c.finish_reason) == (12, "length") or (
            c.token_ids[-1] == tok.eos_token_id and c.finish_reason == "stop"
        )
    for c in out:  # raw logprobs: the model's own distribution, whatever the temperature
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _forward_logprobs(model, prompt, c.token_ids), atol=1e-5, rtol=0
        )


def test_seeds_reproduce_in_any_batch(engine, tok):
    prompt = tok.encode("1 + 2 =")
    alone = engine.generate([_req("a", prompt, n=2, seed=42, max_new_tokens=8)])
    other = _req("b", tok.encode("9"), max_new_tokens=20)
    mixed = engine.generate([other, _req("a", prompt, n=2, seed=42, max_new_tokens=8)])[1:]
    assert [c.token_ids for c in alone] == [c.token_ids for c in mixed]
    assert alone[0].token_ids != alone[1].token_ids  # the n samples of one seed differ
    reseeded = engine.generate([_req("a", prompt, n=2, seed=43, max_new_tokens=8)])
    assert reseeded[0].token_ids != alone[0].token_ids


def test_stop_ids_and_max_tokens(engine, tok):
    prompt = tok.encode("12 + 7 =")
    greedy = engine.generate([_req("g", prompt, temperature=0, max_new_tokens=10)])[0].token_ids
    stop = greedy[3]
    first = greedy.index(stop)  # generation ends at the first occurrence, stop token included
    out = engine.generate([_req("s", prompt, temperature=0, max_new_tokens=10, stop_token_ids=[stop])])[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    short = engine.generate([_req("m", prompt, temperature=0, max_new_tokens=3)])[0]
    assert short.token_ids == greedy[:3] and short.finish_reason == "length"


def test_rows_that_stop_early_leave_the_batch_without_changing_the_others(engine, model, tok):
    prompts = [tok.encode(t) for t in ["12 + 7 =", "3", "25 + 25 = 50, 1 + 1 =", "6 + 1"]]
    alone = [engine.generate([_req("x", p, temperature=0, max_new_tokens=12)])[0].token_ids for p in prompts]
    stop = alone[3][2]  # row 3 stops at its third token (or earlier if that id came before)
    reqs = [
        _req("r0", prompts[0], temperature=0, max_new_tokens=2),
        _req("r1", prompts[1], temperature=0, max_new_tokens=12),
        _req("r2", prompts[2], temperature=0, max_new_tokens=7),
        _req("r3", prompts[3], temperature=0, max_new_tokens=12, stop_token_ids=[stop]),
    ]
    out = engine.generate(reqs)  # rows leave the batch after 2, 7 and <= 3 steps; r1 runs on alone
    assert [c.token_ids for c in out] == [
        alone[0][:2],
        alone[1],
        alone[2][:7],
        alone[3][: alone[3].index(stop) + 1],
    ]
    assert [c.finish_reason for c in out] == ["length", "length", "length", "stop"]
    for prompt, c in zip(prompts, out, strict=True):
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _forward_logprobs(model, prompt, c.token_ids), atol=1e-5, rtol=0
        )


def test_generation_stops_at_the_context(engine, tok):
    prompt = [5] * (CONTEXT - 3)  # room for 3 more tokens
    out = engine.generate([_req("c", prompt, temperature=0, max_new_tokens=10)])[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_bad_requests_fail_alone(engine, tok):
    good = _req("ok", tok.encode("4 + 4 ="), temperature=0, max_new_tokens=5)
    zero = _req("zero", tok.encode("1"))
    msgspec.structs.force_setattr(zero.sampling, "max_new_tokens", 0)  # as if built around the validation
    image = b'{"request_id":"img","prompt":{"token_ids":[1],"media":[{"kind":"image","uri":"/nope.png"}]}}'
    bad = [
        _req("empty", []),
        zero,
        _req("long", [5] * CONTEXT),
        _req("vocab", [1, len(tok)]),
        msgspec.json.decode(image, type=GenerateRequest),
    ]
    out = engine.generate([bad[0], good, *bad[1:]])
    by_id = {c.request_id: c for c in out}
    assert (
        by_id["ok"].token_ids == engine.generate([good])[0].token_ids
        and by_id["ok"].finish_reason == "length"
    )
    assert {rid: by_id[rid].error for rid in ["empty", "zero", "long", "vocab", "img"]} == {
        "empty": "request empty: prompt.token_ids is empty",
        "zero": "request zero: sampling.max_new_tokens must be >= 1, got 0",
        "long": f"request long: prompt has {CONTEXT} tokens; the model's context is {CONTEXT}",
        "vocab": f"request vocab: token id {len(tok)} is outside the vocabulary [0, {len(tok)})",
        "img": "request img: prompt has media but the engine has no VLM and processor",
    }
    assert all(by_id[r].finish_reason == "error" and by_id[r].token_ids == [] for r in by_id if r != "ok")


def _submit_at_forward(engine, k, requests):
    """Submit `requests` from inside the engine's k-th forward from now (so they are queued while a batch
    decodes, at a known step); returns (hook handle, their futures' list, answered request ids in order)."""
    forwards, futures, answered = [0], [], []

    def hook(*_):
        forwards[0] += 1
        if forwards[0] == k:
            futures.extend(engine.submit(requests))
            for req, fut in zip(requests, futures, strict=True):
                fut.add_done_callback(lambda _, rid=req.request_id: answered.append(rid))

    return engine.model.register_forward_hook(hook), futures, answered


def _alone(model, tok, prompt, n):
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id
    )
    return ref[0, len(prompt) :].tolist()


def test_a_request_queued_during_a_long_batch_joins_it_and_is_answered_first(engine, model, tok):
    """Continuous batching: rows queued while a batch decodes join it at the next step (only they are
    prefilled) and are answered when they end, long before the batch's long row; every row's greedy tokens
    are those it gets decoded alone (the running row's too: the merged KV cache changes nothing for it)."""
    later = [
        _req("b", tok.encode("2"), temperature=0, max_new_tokens=4),
        _req("c", tok.encode("12 + 7 ="), temperature=0, max_new_tokens=5),
    ]
    start = dict(engine.stats)
    hook, futures, answered = _submit_at_forward(engine, 3, later)  # the prefill, then 2 decode steps
    try:
        first = engine.submit([_req("long", tok.encode("1 +"), temperature=0, max_new_tokens=40)])
        first[0].add_done_callback(lambda _: answered.append("long"))
        long = first[0].result()[0]
        b, c = (f.result()[0] for f in futures)
    finally:
        hook.remove()
    assert answered == ["b", "c", "long"]
    assert engine.stats["batches"] == start["batches"] + 1 and list(engine.recent_batches)[-1] == ["long"]
    assert (engine.stats["admissions"], engine.stats["admitted_rows"]) == (
        start["admissions"] + 1,
        start["admitted_rows"] + 2,
    )
    assert len(long.token_ids) == 40 and long.token_ids == _alone(model, tok, tok.encode("1 +"), 40)
    assert b.token_ids == _alone(model, tok, tok.encode("2"), 4)
    assert c.token_ids == _alone(model, tok, tok.encode("12 + 7 ="), 5)
    torch.testing.assert_close(
        torch.tensor(c.logprobs),
        _forward_logprobs(model, tok.encode("12 + 7 ="), c.token_ids),
        atol=1e-4,
        rtol=1e-4,
    )
    assert long.version_runs == [(0, 40)] and c.version_runs == [(0, 5)]


def test_seeded_rows_sample_the_same_tokens_with_or_without_a_join(engine, tok):
    """A seeded row's stream goes on across a join, and a joined seeded row draws from its own: both sample
    exactly what they sample alone."""
    long = _req("sl", tok.encode("1 +"), temperature=1.0, max_new_tokens=30, seed=11)
    joined = _req("sj", tok.encode("3"), temperature=1.0, max_new_tokens=6, seed=12, n=2)
    alone = engine.generate([long]) + engine.generate([joined])
    hook, futures, answered = _submit_at_forward(engine, 4, [joined])
    try:
        together = engine.submit([long])[0].result() + futures[0].result()
    finally:
        hook.remove()
    assert answered == ["sj"] and [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_rows_queued_while_an_update_waits_are_not_joined(model, tok):
    """A weight update (not partial) waits for the running batch to end: rows queued meanwhile join no
    more (the batch would never end under a steady stream of turns), they wait and decode under the new
    weights."""
    import threading

    eng = HFEngine(model, tok, max_batch_size=8)
    forwards, loader, late = [0], [], []

    def hook(*_):
        forwards[0] += 1
        if forwards[0] == 3:  # the long batch decodes: an update arrives and waits for it
            state = list(model.state_dict().items())
            loader.append(threading.Thread(target=eng.load_weights, args=(state, 9)))
            loader[0].start()
            while not eng._waiting:  # the updating thread is waiting for the batch (the worker is here)
                loader[0].join(0.001)
        if forwards[0] == 5:
            late.extend(eng.submit([_req("late", tok.encode("2"), temperature=0, max_new_tokens=3)]))

    handle = eng.model.register_forward_hook(hook)
    try:
        long = eng.submit([_req("long", tok.encode("1 +"), temperature=0, max_new_tokens=20)])[0].result()[0]
        after = late[0].result()[0]
        loader[0].join()
    finally:
        handle.remove()
        eng.close()
    assert (long.policy_version, after.policy_version, eng.stats["admitted_rows"]) == (0, 9, 0)
    assert list(eng.recent_batches) == [["long"], ["late"]]


def test_constrained_rows_wait_for_the_next_batch(engine, tok):
    """A constrained row (allowed ids) queued during a batch is not joined into it: it is answered after the
    batch, in a batch of its own."""
    start = dict(engine.stats)
    allowed = _req("a", tok.encode("2"), temperature=0, max_new_tokens=3, allowed_token_ids=[5, 6])
    hook, futures, answered = _submit_at_forward(engine, 3, [allowed])
    try:
        first = engine.submit([_req("long2", tok.encode("1 +"), temperature=0, max_new_tokens=20)])
        first[0].add_done_callback(lambda _: answered.append("long2"))
        first[0].result()
        out = futures[0].result()[0]
    finally:
        hook.remove()
    assert answered == ["long2", "a"] and set(out.token_ids) <= {5, 6} and len(out.token_ids) == 3
    assert engine.stats["admitted_rows"] == start["admitted_rows"]
    assert list(engine.recent_batches)[-2:] == [["long2"], ["a"]]


def test_stream_yields_every_completion(engine, tok):
    async def collect():
        reqs = [_req(f"s{i}", tok.encode(f"{i} +"), n=2, max_new_tokens=4, seed=i) for i in range(3)]
        return [c async for c in engine.stream(reqs)], engine.generate(reqs)

    streamed, batch = asyncio.run(collect())
    key = lambda c: (c.request_id, c.index)  # noqa: E731
    assert sorted(streamed, key=key) == sorted(batch, key=key) and len(streamed) == 6


def test_a_cancelled_request_does_not_stop_the_engine(engine, tok):
    futures = engine.submit(
        [_req("c1", tok.encode("1 +"), max_new_tokens=30), _req("c2", tok.encode("2"), max_new_tokens=2)]
    )
    futures[0].cancel()  # the caller gave up (e.g. an abandoned stream); the worker must keep serving
    assert (
        len(engine.generate([_req("after", tok.encode("3"), temperature=0, max_new_tokens=3)])[0].token_ids)
        == 3
    )


@pytest.mark.parametrize("path", ["buckets", "in_process"])
def test_update_weights_matches_a_fresh_engine(model, tok, path):
    new = tiny_causal_lm(len(tok), seed=7, max_position_embeddings=CONTEXT)
    buckets = make_buckets(list(new.state_dict().items()), max_bytes=32 * 1024, version=5)
    assert len(buckets) > 1  # several buckets really cross
    reqs = [
        _req(f"u{i}", tok.encode(p), temperature=0, max_new_tokens=8) for i, p in enumerate(["1 + 1 =", "20"])
    ]
    eng = HFEngine(tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT), tok)
    fresh = HFEngine(new, tok)
    try:
        before = eng.generate(reqs)
        if path == "buckets":
            eng.update_weights(buckets, version=5)
        else:  # colocated sync hands tensors over in process (the controller's receiver protocol)
            eng.load_weights(list(new.state_dict().items()), version=5)
        after, expected = eng.generate(reqs), fresh.generate(reqs)
    finally:
        eng.close()
        fresh.close()
    assert [c.token_ids for c in after] == [c.token_ids for c in expected] != [c.token_ids for c in before]
    for a, e in zip(after, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), atol=1e-6, rtol=0)
    assert {c.policy_version for c in before} == {0} and {c.policy_version for c in after} == {5}
    assert eng.policy_version == 5


def test_partial_update_resumes_a_running_batch_under_the_new_weights(model, tok):
    """partial=True: a weight update lands between two decode steps of a running batch. The long row's
    first S tokens are the old policy's greedy tokens, the rest the new policy's greedy continuation of
    prompt + those S tokens (KV recomputed), with logprobs of a fresh forward of each; version_runs says so.
    A row that ended before the update has one run."""
    import threading

    new = tiny_causal_lm(len(tok), seed=7, max_position_embeddings=CONTEXT)
    old = tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT)
    eng = HFEngine(tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT), tok, partial=True)
    forwards, third = [0], threading.Event()

    def count(
        *_,
    ):  # the engine's 3rd forward (prefill + 2 steps): a step well inside the long row's 40 tokens
        forwards[0] += 1
        if forwards[0] == 3:
            third.set()

    hook = eng.model.register_forward_hook(count)
    prompt = tok.encode("1 +")
    try:
        futures = eng.submit(
            [
                _req("long", prompt, temperature=0, max_new_tokens=40),
                _req("short", prompt, temperature=0, max_new_tokens=1),
            ]
        )
        third.wait(timeout=60)
        eng.load_weights(list(new.state_dict().items()), version=5)  # returns once loaded mid-batch
        long, short = (f.result()[0] for f in futures)
    finally:
        hook.remove()
        eng.close()
    (v0, s), (v1, rest) = long.version_runs
    assert (v0, v1, long.policy_version, eng.policy_version) == (0, 5, 0, 5)
    assert s >= 2 and rest > 0 and s + rest == len(long.token_ids) and eng.stats["resumed_rows"] == 1
    assert short.version_runs == [(0, 1)] and short.token_ids == long.token_ids[:1]
    head, tail = long.token_ids[:s], long.token_ids[s:]
    ref_old = old.generate(
        torch.tensor([prompt]), max_new_tokens=s, do_sample=False, eos_token_id=tok.eos_token_id
    )
    assert ref_old[0, len(prompt) :].tolist() == head
    ref_new = new.generate(
        torch.tensor([prompt + head]), max_new_tokens=40 - s, do_sample=False, eos_token_id=tok.eos_token_id
    )
    assert ref_new[0, len(prompt) + s :].tolist() == tail
    expected = torch.cat([_forward_logprobs(old, prompt, head), _forward_logprobs(new, prompt + head, tail)])
    torch.testing.assert_close(torch.tensor(long.logprobs), expected, atol=1e-5, rtol=0)


def test_a_partial_update_between_batches_loads_at_once(model, tok):
    eng = HFEngine(tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT), tok, partial=True)
    new = tiny_causal_lm(len(tok), seed=7, max_position_embeddings=CONTEXT)
    try:
        eng.load_weights(list(new.state_dict().items()), version=2)  # idle engine: no batch to pause
        (out,) = eng.generate([_req("a", tok.encode("2 +"), temperature=0, max_new_tokens=5)])
    finally:
        eng.close()
    assert out.version_runs == [(2, len(out.token_ids))] and out.policy_version == 2


def test_update_copies_into_the_existing_parameters(model, tok):
    eng = HFEngine(tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT), tok)
    storage = {name: p.data_ptr() for name, p in eng.model.named_parameters()}
    new = {
        k: v.double() for k, v in tiny_causal_lm(len(tok), seed=3).state_dict().items()
    }  # cast in the copy
    try:
        eng.update_weights(make_buckets(list(new.items()), max_bytes=1 << 20), version=2)
        assert {name: p.data_ptr() for name, p in eng.model.named_parameters()} == storage  # no new tensors
        assert all(torch.equal(p, new[name].float()) for name, p in eng.model.named_parameters())
        assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    finally:
        eng.close()


def test_bad_update_leaves_the_model_untouched(tok):
    eng = HFEngine(tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT), tok)
    snapshot = {k: v.clone() for k, v in eng.model.state_dict().items()}
    good = ("model.norm.weight", torch.zeros(64))
    try:
        with pytest.raises(ValueError, match=r"unknown tensor name 'model\.nope\.weight'"):
            eng.update_weights(
                make_buckets([good, ("model.nope.weight", torch.zeros(2))], max_bytes=1 << 20), 1
            )
        with pytest.raises(
            ValueError, match=r"'lm_head.weight' has shape \[3, 64\], the model's is \[262, 64\]"
        ):
            eng.update_weights(
                make_buckets([good, ("lm_head.weight", torch.zeros(3, 64))], max_bytes=1 << 20), 1
            )
        assert all(torch.equal(v, snapshot[k]) for k, v in eng.model.state_dict().items())
        assert eng.policy_version == 0
    finally:
        eng.close()


def test_sleep_levels(tok):
    model = tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT)
    state = [(k, v.clone()) for k, v in model.state_dict().items()]
    eng = HFEngine(model, tok)
    req = [_req("z", tok.encode("5 + 5 ="), temperature=0, max_new_tokens=6)]
    try:
        before = eng.generate(req)[0].token_ids
        eng.sleep()
        with pytest.raises(RuntimeError, match="HFEngine is asleep: call wake_up"):
            eng.generate(req)
        eng.wake_up()
        assert eng.generate(req)[0].token_ids == before
        eng.sleep(level=2)  # weights discarded: storage released
        assert all(p.numel() == 0 for p in eng.model.parameters())
        eng.wake_up()
        # 27 = embeddings + 2 layers x (q/k/v weight and bias, o, gate, up, down, 2 norms) + final norm + lm_head
        with pytest.raises(RuntimeError, match=r"HFEngine has no weights for 27 tensors \(discarded"):
            eng.generate(req)
        eng.update_weights(make_buckets(state, max_bytes=1 << 20), version=1)
        again = eng.generate(req)[0]
    finally:
        eng.close()
    assert again.token_ids == before and again.policy_version == 1


CHOICES = ["1", "12", "12 + 7", "no"]  # "1" is a prefix of "12", which is a prefix of "12 + 7"


def _allowed_sets(tok, choices, tokens):
    """By hand from the choices' token ids: the tokens allowed at each position of `tokens`."""
    seqs = [tok.encode(c, add_special_tokens=False) for c in choices]
    out = []
    for j in range(len(tokens)):
        prefix = tokens[:j]
        nxt = {s[j] for s in seqs if len(s) > j and s[:j] == prefix}
        out.append(nxt | ({tok.eos_token_id} if prefix in seqs else set()))
    return out


def test_choices_every_output_is_one_of_them_with_constrained_logprobs(engine, model, tok):
    prompt = tok.encode("12 + 7 =")
    reqs = [
        _req(f"c{i}", prompt, n=8, temperature=1.5, max_new_tokens=12, seed=i, choices=CHOICES)
        for i in range(3)
    ]
    out = engine.generate(reqs)
    assert len(out) == 24
    for c in out:
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id
        assert tok.decode(c.token_ids[:-1]) in CHOICES
    assert len({tok.decode(c.token_ids[:-1]) for c in out}) >= 3  # a random model picks among them
    for c in out[:6]:  # logprobs: log_softmax over the allowed tokens only, at every position
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        for j, allowed in enumerate(_allowed_sets(tok, CHOICES, c.token_ids)):
            masked = torch.full_like(logits[j], float("-inf"))
            masked[list(allowed)] = logits[j, list(allowed)]
            assert c.logprobs[j] == pytest.approx(masked.log_softmax(-1)[c.token_ids[j]].item(), abs=1e-5)


def test_constrained_and_free_rows_share_a_batch(engine, tok):
    free = _req("free", tok.encode("3 +"), temperature=0, max_new_tokens=10)
    greedy_choice = _req("choice", tok.encode("3 +"), temperature=0, max_new_tokens=10, choices=["no", "12"])
    allowed = [tok.eos_token_id, *tok.encode("0123", add_special_tokens=False)]
    only = _req("ids", tok.encode("3 +"), n=4, max_new_tokens=10, seed=1, allowed_token_ids=allowed)
    alone = engine.generate([free])[0].token_ids
    out = engine.generate([free, greedy_choice, only])
    assert out[0].token_ids == alone  # the free row is untouched by its neighbours' constraints
    assert tok.decode(out[1].token_ids[:-1]) in ["no", "12"] and out[1].finish_reason == "stop"
    assert (
        all(set(c.token_ids) <= set(allowed) for c in out[2:]) and sum(len(c.token_ids) for c in out[2:]) > 4
    )


def test_constraint_errors_name_the_field(engine, tok):
    reqs = [  # "12 + 7" is 5 tokens: '1', '2', ' +', ' ', '7'
        _req("short", tok.encode("1"), max_new_tokens=3, choices=["12 + 7", "no"]),
        _req("oov", tok.encode("1"), allowed_token_ids=[1, 10_000]),
    ]
    by_id = {c.request_id: c for c in engine.generate(reqs)}
    assert {r: (c.finish_reason, c.error) for r, c in by_id.items()} == {
        "short": (
            "error",
            "request short: sampling.max_new_tokens is 3; the longest choice takes 6 tokens with eos",
        ),
        "oov": (
            "error",
            f"request oov: sampling.allowed_token_ids has 10000, outside the vocabulary [0, {len(tok)})",
        ),
    }
    no_tok = HFEngine(engine.model, None)
    try:
        out = no_tok.generate([_req("nt", tok.encode("1"), choices=["no"])])[0]
    finally:
        no_tok.close()
    assert out.error == "request nt: sampling.choices needs a tokenizer; this HFEngine has none"


def _resident_bytes():
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_sleep_level_2_frees_the_weights_resident_memory(tok):
    # about 24 MiB of parameters: large allocations, which the allocator returns to the system when freed
    model = tiny_causal_lm(4096, hidden_size=512, num_layers=1, num_heads=8, head_dim=64, seed=0)
    state = [(k, v.clone()) for k, v in model.state_dict().items()]
    eng = HFEngine(model, tok)
    reqs = [_req("w", tok.encode("5 + 5 ="), n=2, max_new_tokens=8, seed=4)]
    try:
        before = eng.generate(reqs)
        weights = eng.slots.nbytes
        assert weights == sum(v.numel() * 4 for _, v in state) > 20 << 20
        resident = _resident_bytes()
        eng.sleep(level=2)
        freed = resident - _resident_bytes()
        eng.wake_up()
        # 15 = embeddings + 1 layer x (q/k/v weight and bias, o, gate, up, down, 2 norms) + final norm + lm_head
        with pytest.raises(
            RuntimeError, match=r"HFEngine has no weights for 15 tensors \(discarded by sleep"
        ):
            eng.generate(reqs)
        eng.load_weights(state, version=2)
        after = eng.generate(reqs)
    finally:
        eng.close()
    assert freed >= weights, f"resident memory fell by {freed} bytes, the weights are {weights}"
    assert [(c.token_ids, c.logprobs) for c in after] == [(c.token_ids, c.logprobs) for c in before]
    assert {c.policy_version for c in after} == {2}
