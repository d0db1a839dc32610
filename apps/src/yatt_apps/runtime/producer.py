"""Asynchronous rollouts with bounded staleness (`algo.max_staleness = k > 0`): each controller runs its own
producer, which keeps k batches of generation and scoring in flight while the step trains.

At step 0 the producer launches the step's own batch and the next k batches of this controller's shard (drawn
with `ctx.next_batch()`, so the data cursor and its checkpoint follow); at every later step it launches the batch
the step was given. The step then trains on the oldest launched batch. A batch's rollout calls are all
submitted at launch, before that step's weight push is queued behind them on the rollout hosts, so every
sample of a batch is made by the policy of its launch step: a batch trained at step s was made by version
s - k or later, and every sample is checked against that bound. Scoring continues in a background thread.
The last k batches launched are never trained (dropped, deterministically).

Overlap needs the rollout engines on other processes than the learner (disaggregated placement): in full
colocation the engines and the learner share each device's process and time-share it, so async is refused
there. At a checkpoint the queue is awaited and stored with the controller's state, so a resumed run trains
the same next batches as one that never stopped.

Partial rollouts (`rollout.partial = true`): the engines apply a weight push between two decode steps of the
generations in flight (KV cache recomputed) instead of after them, so the push no longer waits for the
launched batches. A completion then carries tokens of several versions (`Completion.version_runs`); its
staleness is that of its oldest token, which is still made by the launch step's policy or a later one, so
the bound k holds. `async/partial_resumed` counts the trained completions that span more than one version.

State: a `Producer` per controller rank, in the `Producers` the step function holds (built with it, so each
controller process's copy of the step function has its own; nothing lives at module level).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from yatt_apps.config import RunConfig
from yatt_apps.io.data import PromptRow


@dataclass
class Launched:
    """One batch in flight: its rows and prompt ids, the step that launched it, and its `Scored` future."""

    step: int
    rows: list[PromptRow]
    prompt_ids: list[list[int]]
    scored: Future


def check_async(cfg: RunConfig) -> None:
    """Config errors of async training (its placement is checked against the plan, in
    `launch.check_async_placement`)."""
    if cfg.rollout.partial and not cfg.algo.max_staleness:
        raise ValueError(
            "rollout.partial=true needs algo.max_staleness > 0: on-policy steps have no generation in flight "
            "when the weights are pushed, so there is nothing to pause and resume"
        )


class Producer:
    """One controller's producer: its launched batches (oldest first), the recent (start, end) times of its
    train phases, and the thread that streams each launched batch into scoring."""

    def __init__(self) -> None:
        self.queue: deque[Launched] = deque()
        self.trains: deque[tuple[float, float]] = deque(maxlen=64)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="yatt-producer")

    def launch(self, ctx: Any, cfg: RunConfig, rows: list[PromptRow], tok: Any, step: int) -> Launched:
        """Submit every rollout call of `rows` now (they queue ahead of this step's weight push), then stream
        the completions into scoring on a background thread."""
        from yatt_apps.runtime.phases import (
            chunks_per_replica,
            make_requests,
            render_prompt,
            sample_seed,
            score_stream,
            submit_rollout,
        )

        prompt_ids = [render_prompt(tok, row, cfg.data.system_prompt) for row in rows]
        seed = sample_seed(cfg, ctx, step=step)
        tag = f"s{step}-c{ctx.rank}"
        requests = make_requests(rows, prompt_ids, cfg.sampling, tag, seed)
        refs = submit_rollout(ctx, requests, chunks_per_replica(cfg))
        future = self.pool.submit(score_stream, ctx, rows, refs, tok)
        return Launched(step, rows, prompt_ids, future)

    def next_batch(self, ctx: Any, cfg: RunConfig, rows: list[PromptRow], tok: Any) -> tuple[Launched, Any]:
        """Launch this step's batch (and, at the first step, the k after it); return the oldest launched batch
        and its `Scored` (waited for), whose samples are at most k policy versions old."""
        k = cfg.algo.max_staleness
        restored = ctx.state.pop("async_queue", None)
        if restored is not None:
            self.queue.clear()
            self.queue.extend(_restore(restored))
        if not self.queue:  # a fresh run (or a resumed one without a stored queue): fill the window
            self.queue.append(self.launch(ctx, cfg, rows, tok, ctx.step))
            for ahead in range(1, k + 1):
                self.queue.append(self.launch(ctx, cfg, ctx.next_batch(), tok, ctx.step + ahead))
        else:
            self.queue.append(self.launch(ctx, cfg, rows, tok, ctx.step + k))
        oldest = self.queue.popleft()
        scored = oldest.scored.result()
        ctx.check_versions([oldest_version(c) for c in scored.completions], max_staleness=k)
        return oldest, scored

    def async_sums(
        self, ctx: Any, scored: Any, kept: list[int], version: int, train: tuple[float, float]
    ) -> dict[str, float]:
        """Per trained sample, the updated policy's `version` - the version that made it (sum, count; the max
        is all-reduced here), and how long this step's training overlapped the rollouts then in flight (the
        launched batches still being generated or scored when training began or after: a batch's production
        runs from its first generation request to its last scored chunk; measured when each is consumed)."""
        ages = [version - oldest_version(scored.completions[i]) for i in kept]
        resumed = sum(len(set(versions(scored.completions[i]))) > 1 for i in kept)
        self.trains.append(train)
        start = scored.stream.get("rollout_start", 0.0)
        end = scored.stream.get("reward_end", scored.stream.get("rollout_end", 0.0))
        overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.trains)
        peak = ctx.all_reduce({"max": float(max(ages, default=0))}, "max")["max"]
        return {
            "async/staleness/sum": float(sum(ages)),
            "async/samples": float(len(ages)),
            "async/staleness_max_all": peak,
            "async/overlap_s": overlap,
            "async/partial_resumed/sum": float(resumed),  # completions whose tokens span a weight update
        }

    def store_queue(self, ctx: Any, cfg: RunConfig) -> None:
        """Before a checkpoint: wait for every launched batch and keep them in the controller's state."""
        every = cfg.controller.checkpoint_every
        last = ctx.step == cfg.run.num_steps - 1
        if not every or ((ctx.step + 1) % every and not last):
            return
        ctx.state["async_queue"] = [_encode(item) for item in self.queue]


class Producers:
    """Each controller rank's `Producer`, created on its first step. Held by the step function; a copy sent
    to another process (the step function travels to every controller) starts empty: batches in flight
    belong to the process that launched them, and reach a restarted controller only through its checkpoint."""

    def __init__(self) -> None:
        self.by_rank: dict[int, Producer] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.by_rank = {}

    def of(self, rank: int) -> Producer:
        """This controller rank's producer."""
        return self.by_rank.setdefault(rank, Producer())


def versions(completion: Any) -> list[int]:
    """The policy versions of a completion's tokens, run by run (a multi-turn `Trajectory` has one run)."""
    runs = completion.runs() if hasattr(completion, "runs") else []
    return [v for v, _ in runs] or [completion.policy_version]


def oldest_version(completion: Any) -> int:
    """The version a staleness bound is checked against: that of the completion's oldest token."""
    return min(versions(completion))


def _encode(item: Launched) -> dict[str, Any]:
    scored = item.scored.result()
    return {
        "step": item.step,
        "rows": [msgspec.to_builtins(r) for r in item.rows],
        "prompt_ids": item.prompt_ids,
        "scored": msgspec.to_builtins(_scored_doc(scored)),
    }


def _scored_doc(scored) -> dict[str, Any]:
    return {
        "completions": scored.completions,
        "owner": scored.owner,
        "scores": scored.scores,
        "keep": scored.keep,
        "statuses": scored.statuses,
        "components": scored.components,
        "stream": scored.stream,
    }


def _restore(docs: list[dict[str, Any]]) -> list[Launched]:
    from yatt_rollout.types import Completion

    from yatt_apps.runtime.phases import Scored

    out = []
    for doc in docs:
        s = doc["scored"]
        scored = Scored(
            completions=[msgspec.convert(c, Completion) for c in s["completions"]],
            owner=s["owner"],
            scores=s["scores"],
            keep=s["keep"],
            statuses=s["statuses"],
            components=s["components"],
            stream=s["stream"],
        )
        done: Future = Future()
        done.set_result(scored)
        rows = [msgspec.convert(r, PromptRow) for r in doc["rows"]]
        out.append(Launched(doc["step"], rows, doc["prompt_ids"], done))
    return out
