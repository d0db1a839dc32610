"""ReplicaClient: assignment by outstanding work (worked by hand with a scripted replica double), per-replica
load reports, failures, and the real path over two HFEngine replicas."""

import threading

import pytest
from yatt_rollout.client import ReplicaClient, request_work
from yatt_rollout.types import Completion, GenerateRequest, Generator, Prompt, ReplicaLoad, SamplingParams


class ScriptedReplica:
    """Test double of an engine replica: answers each sample with `k` copies of its own id as tokens,
    records what it was sent, can hold its answer until `release` is set, and fails requests named "bad"."""

    def __init__(self, rid: int, k: int = 2):
        self.rid, self.k, self.seen = rid, k, []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.version = 0

    @property
    def policy_version(self):
        return self.version

    def generate(self, requests):
        self.seen.append([r.request_id for r in requests])
        self.entered.set()
        self.release.wait()
        if any(r.request_id == "boom" for r in requests):
            raise RuntimeError("replica died")
        return [
            Completion(
                request_id=r.request_id,
                index=i,
                token_ids=[] if r.request_id == "bad" else [self.rid] * self.k,
                logprobs=[] if r.request_id == "bad" else [-1.0] * self.k,
                finish_reason="error" if r.request_id == "bad" else "length",
                policy_version=self.version,
                error="bad" if r.request_id == "bad" else "",
            )
            for r in requests
            for i in range(r.sampling.n)
        ]

    def stream(self, requests):
        raise NotImplementedError

    def update_weights(self, buckets, version):
        self.version = version

    def sleep(self, level=1):
        pass

    def wake_up(self):
        pass


def _req(rid, prompt_len, max_new, n=1):
    return GenerateRequest(
        request_id=rid,
        prompt=Prompt(token_ids=[1] * prompt_len),
        sampling=SamplingParams(n=n, max_new_tokens=max_new),
    )


# work = n * (prompt + max_new): A 10, B 10, C 30, D 5, E 5 (E has n=1)
WORKLOAD = [_req("A", 2, 8), _req("B", 4, 6), _req("C", 10, 20), _req("D", 1, 4), _req("E", 3, 2)]


def test_request_work():
    assert [request_work(r) for r in WORKLOAD] == [10, 10, 30, 5, 5]
    assert request_work(_req("n", 3, 5, n=4)) == 32


def test_assignment_follows_outstanding_work():
    replicas = [ScriptedReplica(0), ScriptedReplica(1)]
    client = ReplicaClient(replicas)
    # A->r0 (tie, lowest index; r0=10), B->r1 (r1=10), C->r0 (tie; r0=40), D->r1 (15), E->r1 (20)
    out = client.generate(WORKLOAD)
    assert [r.seen for r in replicas] == [[["A", "C"]], [["B", "D", "E"]]]
    assert [(c.request_id, c.token_ids) for c in out] == [
        ("A", [0, 0]),
        ("B", [1, 1]),
        ("C", [0, 0]),
        ("D", [1, 1]),
        ("E", [1, 1]),
    ]
    assert client.load() == [
        ReplicaLoad(
            replica=0, outstanding_requests=0, outstanding_tokens=0, completed_requests=2, generated_tokens=4
        ),
        ReplicaLoad(
            replica=1, outstanding_requests=0, outstanding_tokens=0, completed_requests=3, generated_tokens=6
        ),
    ]
    client.close()


def test_concurrent_callers_see_outstanding_work():
    replicas = [ScriptedReplica(0), ScriptedReplica(1)]
    client = ReplicaClient(replicas)
    replicas[0].release.clear()
    first = threading.Thread(target=client.generate, args=([_req("big", 50, 50)],))
    first.start()
    replicas[0].entered.wait()
    assert [(x.outstanding_requests, x.outstanding_tokens) for x in client.load()] == [(1, 100), (0, 0)]
    # while r0 holds 100 tokens of work, the next three requests (30 each) all go to r1
    second = client.generate([_req("x", 10, 20), _req("y", 10, 20), _req("z", 10, 20)])
    assert [c.token_ids[0] for c in second] == [1, 1, 1]
    replicas[0].release.set()
    first.join()
    assert [x.outstanding_tokens for x in client.load()] == [0, 0]
    client.close()


def test_failures_are_counted_and_released():
    replicas = [ScriptedReplica(0)]
    client = ReplicaClient(replicas)
    out = client.generate([_req("bad", 2, 2), _req("ok", 2, 2)])
    assert [c.finish_reason for c in out] == ["error", "length"]
    with pytest.raises(RuntimeError, match="replica died"):
        client.generate([_req("boom", 2, 2)])
    load = client.load()[0]
    assert (load.outstanding_requests, load.outstanding_tokens) == (0, 0)
    assert (load.completed_requests, load.failed_requests) == (1, 2)
    client.close()


def test_needs_a_replica():
    with pytest.raises(ValueError, match="ReplicaClient needs at least one replica"):
        ReplicaClient([])


def test_over_two_real_hf_engines():
    pytest.importorskip("transformers")
    import asyncio

    from yatt_rollout.buckets import make_buckets
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.tiny import tiny_causal_lm, train_tokenizer

    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(20) for b in range(20)], vocab_size=300)
    engines = [HFEngine(tiny_causal_lm(len(tok), seed=0), tok) for _ in range(2)]
    client = ReplicaClient(engines)
    assert isinstance(client, Generator)
    reqs = [
        GenerateRequest(
            request_id=f"r{i}",
            prompt=Prompt(token_ids=tok.encode(f"{i} + {i} =")),
            sampling=SamplingParams(n=2, seed=i, max_new_tokens=6),
        )
        for i in range(6)
    ]
    try:
        spread = client.generate(reqs)
        single = engines[0].generate(reqs)
        assert [(c.request_id, c.index, c.token_ids) for c in spread] == [
            (c.request_id, c.index, c.token_ids) for c in single
        ]
        assert [x.completed_requests for x in client.load()] == [3, 3]  # equal work alternates replicas

        async def collect():
            return [c async for c in client.stream(reqs)]

        streamed = sorted(asyncio.run(collect()), key=lambda c: (c.request_id, c.index))
        assert [c.token_ids for c in streamed] == [
            c.token_ids for c in sorted(single, key=lambda c: (c.request_id, c.index))
        ]
        new = tiny_causal_lm(len(tok), seed=5)
        client.update_weights(make_buckets(list(new.state_dict().items()), max_bytes=1 << 20), version=2)
        assert client.policy_version == 2 and all(e.policy_version == 2 for e in engines)
    finally:
        client.close()
        for e in engines:
            e.close()
