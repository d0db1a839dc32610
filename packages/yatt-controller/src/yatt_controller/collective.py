"""Small collectives among controllers: all-reduce of metrics and counts, all-gather, barrier.

Controllers meet where the algorithm needs it (metrics, dynamic-sampling counts, checkpoint commits); bulk
tensors never go this way (the learners' own torch.distributed group carries gradients). A rendezvous actor
collects one contribution per rank under a key; every controller issues collectives in the same order
(SPMD), so the key is a per-client sequence number. A collective that does not complete within its timeout
fails naming the ranks that never arrived: never a silent hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import ray

REDUCE_OPS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "mean": lambda xs: sum(xs) / len(xs),
    "max": max,
    "min": min,
}


def reduce_dicts(contributions: Sequence[dict[str, float]], op: str) -> dict[str, float]:
    """Reduce per-rank dicts key by key: [{"n": 2}, {"n": 3}] with "sum" -> {"n": 5}. Keys must agree."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; known: {sorted(REDUCE_OPS)}")
    keys = set(contributions[0])
    for rank, values in enumerate(contributions):
        if set(values) != keys:
            raise ValueError(f"all_reduce: rank {rank} has keys {sorted(values)}, rank 0 has {sorted(keys)}")
    return {key: float(REDUCE_OPS[op]([float(c[key]) for c in contributions])) for key in sorted(keys)}


class Rendezvous:
    """Collects one value per rank under a key and hands every rank the full list. Hosted in the attempt's
    one small actor, beside the roster book (`yatt_controller.roster.AttemptBook`)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._values: dict[Any, dict[int, Any]] = {}
        self._done: dict[Any, asyncio.Event] = {}
        self._left: dict[Any, int] = {}

    async def exchange(self, key: Any, rank: int, value: Any, timeout_s: float) -> list[Any]:
        values = self._values.setdefault(key, {})
        done = self._done.setdefault(key, asyncio.Event())
        values[rank] = value
        if len(values) == self.world_size:
            done.set()
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            missing = sorted(set(range(self.world_size)) - set(values))
            raise TimeoutError(
                f"collective {key!r}: ranks {missing} did not arrive within {timeout_s} s"
            ) from None
        result = [values[r] for r in range(self.world_size)]
        self._left[key] = self._left.get(key, self.world_size) - 1
        if self._left[key] == 0:  # the last reader cleans up
            del self._values[key], self._done[key], self._left[key]
        return result


class Collective:
    """One controller's end of the collectives. `Collective(None, 0, 1)` is the single-controller case:
    every collective returns at once with this rank's own value."""

    def __init__(self, rendezvous: Any, rank: int, world_size: int, *, timeout_s: float = 600.0) -> None:
        self.rendezvous, self.rank, self.world_size, self.timeout_s = rendezvous, rank, world_size, timeout_s
        self._seq = 0

    def all_gather(self, value: Any) -> list[Any]:
        self._seq += 1
        if self.world_size == 1:
            return [value]
        return ray.get(self.rendezvous.exchange.remote(self._seq, self.rank, value, self.timeout_s))

    def all_reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        return reduce_dicts(self.all_gather(dict(values)), op)

    def barrier(self) -> None:
        self.all_gather(None)
