"""Sampling K judgements per prompt through a yatt-rollout `Generator`, with timeouts and a concurrency bound.

Shared by the GenRM and GenPRM judges. Prompts go to `engine.stream` in chunks of at most `max_concurrency`
requests (one request carries all K samples as `SamplingParams.n`), so the engine still batches; each
request in a chunk must be complete within `timeout_s` of the chunk's start, else it is a timeout. Engine
failures (`finish_reason == "error"`) fail that request only.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from yatt_rollout.types import Completion, GenerateRequest, Generator

from yatt_multimodal.types import RewardStatus


@dataclass
class JudgeCall:
    """The K completions of one judge prompt, ordered by sample index, or why there are none."""

    completions: list[Completion]
    status: RewardStatus = "ok"  # "ok" | "timeout" | "error"
    error: str = ""


async def sample_judgements(
    engine: Generator, requests: Sequence[GenerateRequest], *, timeout_s: float, max_concurrency: int
) -> dict[str, JudgeCall]:
    """request_id -> `JudgeCall` for every request."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    calls: dict[str, JudgeCall] = {}
    for start in range(0, len(requests), max_concurrency):
        calls.update(await _run_chunk(engine, requests[start : start + max_concurrency], timeout_s))
    return calls


async def _run_chunk(
    engine: Generator, chunk: Sequence[GenerateRequest], timeout_s: float
) -> dict[str, JudgeCall]:
    wanted = {r.request_id: r.sampling.n for r in chunk}
    got: dict[str, list[Completion]] = defaultdict(list)
    loop = asyncio.get_running_loop()
    deadline, timed_out = loop.time() + timeout_s, False
    stream = engine.stream(chunk)
    try:
        while any(len(got[rid]) < n for rid, n in wanted.items()):
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                completion = await asyncio.wait_for(anext(stream), remaining)
            except TimeoutError:
                timed_out = True
                break
            except StopAsyncIteration:
                break
            got[completion.request_id].append(completion)
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    return {rid: _classify(got[rid], n, timed_out, timeout_s) for rid, n in wanted.items()}


def _classify(completions: list[Completion], n: int, timed_out: bool, timeout_s: float) -> JudgeCall:
    completions = sorted(completions, key=lambda c: c.index)
    failures = [c for c in completions if c.finish_reason == "error"]
    if failures:
        return JudgeCall(
            completions, "error", f"judge engine failed: {failures[0].error or 'no reason given'}"
        )
    if len(completions) < n and timed_out:
        return JudgeCall(
            completions, "timeout", f"judge gave {len(completions)} of {n} judgements within {timeout_s}s"
        )
    if len(completions) < n:
        return JudgeCall(
            completions, "error", f"judge stream ended after {len(completions)} of {n} judgements"
        )
    return JudgeCall(completions)
