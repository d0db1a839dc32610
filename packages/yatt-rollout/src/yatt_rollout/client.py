"""A client that spreads requests over engine replicas by outstanding work, itself a `Generator`.

Each request goes to the replica with the least outstanding work at the moment it is assigned (ties to
the lowest index), and its work, `n * (prompt tokens + max_new_tokens)`, counts against that replica until
its completions return. Assignments from concurrent callers see each other's outstanding work. Replicas
are anything implementing `Generator` (an `HFEngine`, a `VLLMEngine`, a proxy to a remote actor); each
replica's share runs in its own thread so replicas work at the same time. Weight updates, sleep and wake
go to every replica. `load()` reports per-replica counters as `ReplicaLoad` messages.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from yatt_rollout.types import Completion, GenerateRequest, Generator, ReplicaLoad, WeightBucket


def request_work(req: GenerateRequest) -> int:
    """Tokens a replica may have to compute for `req`: n * (prompt + max new tokens)."""
    return req.sampling.n * (len(req.prompt.token_ids) + req.sampling.max_new_tokens)


class ReplicaClient:
    """Load-balancing `Generator` over `replicas`."""

    def __init__(self, replicas: Sequence[Generator]) -> None:
        if not replicas:
            raise ValueError("ReplicaClient needs at least one replica")
        self.replicas = list(replicas)
        self._lock = threading.Lock()
        self._load = [
            ReplicaLoad(replica=i, outstanding_requests=0, outstanding_tokens=0) for i in range(len(replicas))
        ]
        self._pool = ThreadPoolExecutor(max_workers=4 * len(replicas), thread_name_prefix="yatt-replica")

    @property
    def policy_version(self) -> int:
        """The oldest weights any replica holds."""
        return min(r.policy_version for r in self.replicas)

    def load(self) -> list[ReplicaLoad]:
        """A snapshot of every replica's counters."""
        with self._lock:
            return [ReplicaLoad(**{f: getattr(x, f) for f in x.__struct_fields__}) for x in self._load]

    def assign(self, requests: Sequence[GenerateRequest]) -> list[list[int]]:
        """Indices of `requests` per replica, least outstanding work first; counts the work as outstanding."""
        shares: list[list[int]] = [[] for _ in self.replicas]
        with self._lock:
            for i, req in enumerate(requests):
                target = min(range(len(self._load)), key=lambda r: (self._load[r].outstanding_tokens, r))
                shares[target].append(i)
                self._load[target].outstanding_requests += 1
                self._load[target].outstanding_tokens += request_work(req)
        return shares

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Completions in request order, then sample index, as from a single engine."""
        shares = self.assign(requests)
        futures = {
            r: self._pool.submit(self._run_share, r, [requests[i] for i in share])
            for r, share in enumerate(shares)
            if share
        }
        by_request: dict[int, list[Completion]] = {}
        for r, fut in futures.items():
            for i, completions in zip(shares[r], fut.result(), strict=True):
                by_request[i] = completions
        return [c for i in range(len(requests)) for c in by_request[i]]

    async def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[Completion]:
        """Yield each request's completions as its replica returns them."""
        import asyncio

        shares = self.assign(requests)
        tasks = [
            asyncio.wrap_future(self._pool.submit(self._run_one, r, requests[i]))
            for r, share in enumerate(shares)
            for i in share
        ]
        for task in asyncio.as_completed(tasks):
            for completion in await task:
                yield completion

    def update_weights(self, buckets: Sequence[WeightBucket], version: int) -> None:
        for fut in [self._pool.submit(r.update_weights, buckets, version) for r in self.replicas]:
            fut.result()

    def sleep(self, level: int = 1) -> None:
        # every engine's sleep takes a level; the Generator protocol's sleep() leaves it unnamed
        for fut in [self._pool.submit(r.sleep, level=level) for r in self.replicas]:  # type: ignore[call-arg]
            fut.result()

    def wake_up(self) -> None:
        for fut in [self._pool.submit(r.wake_up) for r in self.replicas]:
            fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run_one(self, replica: int, req: GenerateRequest) -> list[Completion]:
        return self._run_share(replica, [req])[0]

    def _run_share(self, replica: int, share: list[GenerateRequest]) -> list[list[Completion]]:
        """Run one replica's share; release its work as it returns (also when the replica raises)."""
        completions: list[Completion] = []
        try:
            completions = self.replicas[replica].generate(share)
        finally:
            self._release(replica, share, completions)
        # a replica returns request order; split by position so duplicate request ids stay apart
        out, cursor = [], 0
        for req in share:
            count = max(req.sampling.n, 1)
            out.append(completions[cursor : cursor + count])
            cursor += count
        return out

    def _release(self, replica: int, share: list[GenerateRequest], completions: list[Completion]) -> None:
        with self._lock:
            load = self._load[replica]
            load.outstanding_requests -= len(share)
            load.outstanding_tokens -= sum(request_work(req) for req in share)
            failed = {c.request_id for c in completions if c.finish_reason == "error"}
            load.failed_requests += len(failed) if completions else len(share)
            load.completed_requests += len(share) - (len(failed) if completions else len(share))
            load.generated_tokens += sum(len(c.token_ids) for c in completions)
