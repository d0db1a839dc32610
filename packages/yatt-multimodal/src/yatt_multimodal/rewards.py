"""The reward interface: a batch of `RewardRequest`s -> a `RewardBatch` of `Reward`s plus counts, async.

Every reward (rule, reward model, judge) implements `RewardFunction.score`. Rules are plain functions
`(RewardRequest) -> float` wrapped by `RuleReward`, which runs them with a per-request deadline: in the
killable worker processes of a `RuleWorkerPool` (`yatt_multimodal.rule_workers`; every rule built from a
`RewardSpec` runs there), or, for a rule known to be finite, in threads. `CombinedReward` sums weighted terms. Failures are statuses, never silent
zeros: `resolve_failures` applies the configured policy (score zero, drop the sample, fail the step).
`score_stream` scores requests as they arrive (rollout streaming finished samples to a judge).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from yatt_multimodal.types import OnFailure, Reward, RewardMetrics, RewardRequest, RewardStatus

if TYPE_CHECKING:
    from yatt_multimodal.rule_workers import RuleOutcome, RuleWorkerPool

# What `resolve_failures` does with each failure status unless told otherwise: the rest of the batch is scored.
DEFAULT_POLICY: dict[str, OnFailure] = {"parse_error": "zero", "timeout": "drop", "error": "drop"}
# Worst first: a combined reward takes the worst status of its terms.
_SEVERITY: dict[str, int] = {"ok": 0, "parse_error": 1, "timeout": 2, "error": 3}


@dataclass
class RewardBatch:
    """The rewards of one `score` call, in request order, and its counts."""

    rewards: list[Reward]
    metrics: RewardMetrics = field(default_factory=RewardMetrics)


@runtime_checkable
class RewardFunction(Protocol):
    """What every reward provides. `score` returns one `Reward` per request, in order, and never raises for
    a single bad request: that request gets a non-ok status. `name` is its key in `Reward.components`."""

    name: str

    async def score(self, requests: Sequence[RewardRequest]) -> RewardBatch: ...


class RewardStepFailed(RuntimeError):
    """Raised by `resolve_failures` when a failure's policy is "fail"."""


def count_statuses(rewards: Sequence[Reward], metrics: RewardMetrics | None = None) -> RewardMetrics:
    """Fill the per-status counts of `metrics` (a fresh one by default) from `rewards`."""
    metrics = metrics if metrics is not None else RewardMetrics()
    metrics.num_requests = len(rewards)
    metrics.num_parse_error = sum(r.status == "parse_error" for r in rewards)
    metrics.num_timeout = sum(r.status == "timeout" for r in rewards)
    metrics.num_error = sum(r.status == "error" for r in rewards)
    return metrics


def failed(request: RewardRequest, status: RewardStatus, error: str) -> Reward:
    """A non-judgement: score 0.0 is a placeholder the status marks as such."""
    return Reward(request_id=request.request_id, score=0.0, status=status, error=error)


class RuleReward:
    """A rule `(RewardRequest) -> float`, each call bounded by `timeout_s`. A rule that raises gets status
    "error" with the message; one that overruns gets "timeout". With a `pool` (a `RuleWorkerPool`) the rule
    runs in its worker processes and an overrunning call is killed there; `owns_pool` makes `close()` close
    it. Without one it runs in `max_concurrency` threads of its own, where an overrunning call is abandoned,
    not killed (Python cannot stop a thread): only for rules known to be finite on any input."""

    def __init__(
        self,
        name: str,
        fn: Callable[[RewardRequest], float],
        *,
        timeout_s: float = 10.0,
        max_concurrency: int = 8,
        pool: RuleWorkerPool | None = None,
        owns_pool: bool = False,
    ):
        if timeout_s <= 0:
            raise ValueError(f"RuleReward({name!r}): timeout_s must be > 0, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"RuleReward({name!r}): max_concurrency must be >= 1, got {max_concurrency}")
        self.name, self.fn, self.timeout_s, self.max_concurrency = name, fn, timeout_s, max_concurrency
        self.pool, self.owns_pool = pool, owns_pool and pool is not None
        # Its own threads: an overrunning rule holds one of these, never the event loop's default executor
        # (which `asyncio.run` joins on exit).
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"rule-{name}")

    def close(self) -> None:
        """Close the worker pool if this reward owns it."""
        if self.owns_pool and self.pool is not None:
            self.pool.close()

    def score_sync(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        """The batch from synchronous code (offline scoring, validation, benchmarks): through the pool, with
        its deadlines, when there is one; else in the calling thread without timeouts."""
        if self.pool is None:
            return self._batch([self._call(r) for r in requests])
        from yatt_multimodal.rule_workers import gathered

        outcomes = gathered(self.pool.submit_many(self.fn, requests, self.timeout_s)).result()
        return self._batch([self._outcome(r, o) for r, o in zip(requests, outcomes, strict=True)])

    async def score(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        if self.pool is not None:
            from yatt_multimodal.rule_workers import gathered

            futures = self.pool.submit_many(self.fn, requests, self.timeout_s)
            outcomes = await asyncio.wrap_future(gathered(futures))  # one wake-up for the batch
            return self._batch([self._outcome(r, o) for r, o in zip(requests, outcomes, strict=True)])
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(request: RewardRequest) -> Reward:
            async with limit:
                try:
                    job = asyncio.get_running_loop().run_in_executor(self._threads, self._call, request)
                    return await asyncio.wait_for(job, self.timeout_s)
                except TimeoutError:
                    return failed(request, "timeout", f"{self.name}: no result within {self.timeout_s}s")

        return self._batch(list(await asyncio.gather(*(one(r) for r in requests))))

    def _call(self, request: RewardRequest) -> Reward:
        try:
            value = float(self.fn(request))
        except Exception as exc:  # a rule's bug or bad row fails this request only, with the reason
            return failed(request, "error", f"{self.name}: {type(exc).__name__}: {exc}")
        return Reward(request_id=request.request_id, score=value, components={self.name: value})

    def _outcome(self, request: RewardRequest, outcome: RuleOutcome) -> Reward:
        if outcome.status == "timeout":
            return failed(
                request, "timeout", f"{self.name}: no result within {self.timeout_s}s ({outcome.error})"
            )
        if outcome.status != "ok":
            return failed(request, "error", f"{self.name}: {outcome.error}")
        return Reward(
            request_id=request.request_id, score=outcome.value, components={self.name: outcome.value}
        )

    def _batch(self, rewards: list[Reward]) -> RewardBatch:
        return RewardBatch(rewards, count_statuses(rewards))


class CombinedReward:
    """`score = sum_i weight_i * score_i` over terms scored concurrently; `components` holds each term's
    score under its name. A term's failure makes the combined reward take the worst term status and its
    error; the failed term contributes nothing to `score`. Per-token scores, where terms give them, are
    combined with the same weights."""

    def __init__(
        self,
        terms: Sequence[tuple[float, RewardFunction]],
        *,
        name: str = "reward",
        owns: Sequence[RuleWorkerPool] = (),
    ):
        if not terms:
            raise ValueError("CombinedReward: terms is empty")
        names = [fn.name for _, fn in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"CombinedReward: term names must be unique, got {names}")
        self.terms, self.name, self.owns = list(terms), name, list(owns)

    def close(self) -> None:
        """Close the terms that can be closed and the pools this reward owns (`build_combined`'s rule pool)."""
        for _, fn in self.terms:
            close = getattr(fn, "close", None)
            if close is not None:
                close()
        for pool in self.owns:
            pool.close()

    async def score(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        batches = await asyncio.gather(*(fn.score(requests) for _, fn in self.terms))
        rewards = [
            self._combine(request, [b.rewards[i] for b in batches]) for i, request in enumerate(requests)
        ]
        metrics = count_statuses(rewards)
        for batch in batches:  # judge counts add up across terms
            metrics.num_judged += batch.metrics.num_judged
            metrics.num_judgements += batch.metrics.num_judgements
            metrics.num_unparsed_judgements += batch.metrics.num_unparsed_judgements
        return RewardBatch(rewards, metrics)

    @property
    def failure_policy(self) -> dict[str, OnFailure]:
        """Per status, the strictest policy of the terms that declare one (fail > drop > zero)."""
        strictness = {"zero": 0, "drop": 1, "fail": 2}
        merged: dict[str, OnFailure] = dict(DEFAULT_POLICY)
        policies = [getattr(fn, "failure_policy", None) for _, fn in self.terms]
        for status in merged:
            declared = [p[status] for p in policies if p is not None and status in p]
            if declared:
                merged[status] = max(declared, key=strictness.__getitem__)
        return merged

    def _combine(self, request: RewardRequest, parts: list[Reward]) -> Reward:
        score, components, errors = 0.0, {}, []
        status: RewardStatus = "ok"
        token_scores: list[float] | None = None
        for (weight, fn), part in zip(self.terms, parts, strict=True):
            assert part.request_id == request.request_id, "a term returned rewards out of order"
            if part.status != "ok":
                errors.append(part.error or f"{fn.name}: {part.status}")
                status = max(status, part.status, key=_SEVERITY.__getitem__)
                continue
            score += weight * part.score
            components.update(part.components)
            if part.token_scores is not None:
                token_scores = token_scores or [0.0] * len(part.token_scores)
                token_scores = [a + weight * b for a, b in zip(token_scores, part.token_scores, strict=True)]
        critique = "\n".join(p.critique for p in parts if p.critique)
        return Reward(
            request_id=request.request_id,
            score=score,
            status=status,
            components=components,
            token_scores=token_scores,
            critique=critique,
            error="; ".join(errors),
        )


@dataclass
class ResolvedRewards:
    """Scores after the failure policy: `keep[i]` False means drop sample i from the step."""

    scores: list[float]
    keep: list[bool]
    metrics: RewardMetrics


def resolve_failures(batch: RewardBatch, policy: Mapping[str, OnFailure] | None = None) -> ResolvedRewards:
    """Apply the failure policy (status -> "zero" | "drop" | "fail") to a batch. The default policy scores
    parse errors zero and drops timeouts and errors (a bad image, a failed engine request): the rest of the
    batch is scored. Every failure is counted in `metrics`;
    "fail" raises `RewardStepFailed` naming the requests."""
    policy = {**DEFAULT_POLICY, **(policy or {})}
    fatal = [r for r in batch.rewards if r.status != "ok" and policy[r.status] == "fail"]
    if fatal:
        detail = "; ".join(f"{r.request_id}: {r.status} ({r.error})" for r in fatal[:5])
        raise RewardStepFailed(f"{len(fatal)} reward(s) failed with policy 'fail': {detail}")
    keep = [r.status == "ok" or policy[r.status] != "drop" for r in batch.rewards]
    # "zero": the failed part scores zero. A lone reward's failed score is already 0.0; a combined reward's
    # is the weighted sum of its other terms, which still count.
    scores = [r.score if r.status == "ok" or policy[r.status] == "zero" else 0.0 for r in batch.rewards]
    metrics = count_statuses(batch.rewards, RewardMetrics(**_counts_of(batch.metrics)))
    metrics.num_dropped = keep.count(False)
    return ResolvedRewards(scores, keep, metrics)


def _counts_of(metrics: RewardMetrics) -> dict[str, int]:
    return {name: getattr(metrics, name) for name in metrics.__struct_fields__}


async def score_stream(
    reward: RewardFunction,
    requests: AsyncIterable[RewardRequest],
    *,
    max_batch: int = 64,
    max_wait_s: float = 0.05,
) -> AsyncIterator[RewardBatch]:
    """Score requests as they arrive: the partial-colocated pipeline, where rollout streams finished samples
    to the judge so that judging overlaps the long tail of generation.

    A reader task drains `requests` into a queue while batches are scored; each batch is the first waiting
    request plus whatever else arrives within `max_wait_s`, at most `max_batch` (dedup works within a batch).
    Yields one `RewardBatch` per batch, in arrival order.
    """
    if max_batch < 1:
        raise ValueError(f"score_stream: max_batch must be >= 1, got {max_batch}")
    queue: asyncio.Queue[RewardRequest | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for request in requests:
                queue.put_nowait(request)
        finally:
            queue.put_nowait(None)  # end of stream (also when the source fails: its error surfaces below)

    reader = asyncio.ensure_future(read())
    try:
        done = False
        while not done:
            first = await queue.get()
            if first is None:
                break
            batch, done = await _gather_batch(queue, first, max_batch, max_wait_s)
            yield await reward.score(batch)
        await reader  # re-raises a failure of the source
    finally:
        reader.cancel()


async def _gather_batch(
    queue: asyncio.Queue[RewardRequest | None], first: RewardRequest, max_batch: int, max_wait_s: float
) -> tuple[list[RewardRequest], bool]:
    """`first` plus what the queue yields within `max_wait_s`, up to `max_batch`; True when the stream ended."""
    batch = [first]
    deadline = asyncio.get_running_loop().time() + max_wait_s
    while len(batch) < max_batch:
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            item = queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(queue.get(), remaining)
        except (asyncio.QueueEmpty, TimeoutError):
            break
        if item is None:
            return batch, True
        batch.append(item)
    return batch, False
