"""Explicit dispatch: how one call on a worker group becomes calls on its workers.

A worker group is a list of workers, each with a data-parallel rank (`dp_rank`) and a rank inside its
model-parallel group (`tp_rank`). Every dispatch function returns object refs, in worker order; only a
controller turns refs into values (`fetch`), and the in-flight window bounds how much work is outstanding.

- broadcast: the same arguments to every worker.
- scatter:   a list split into `dp_size` contiguous chunks; the model-parallel peers of one data-parallel
             rank get the same chunk (they compute one result together).
- shard_rows: a dict of row-sliceable values (tensors [B, ...], lists of length B) cut into `dp_size`
             contiguous row chunks; every worker of data-parallel rank r gets chunk r (SPMD over all ranks).
- rank_zero: only worker 0 (this view's own first rank; a step that trains uses shard_rows, so that in
             single mode every DDP rank joins the call).
- gather:    of the refs a broadcast or scatter returned, one per data-parallel rank (its `tp_rank == 0`
             worker's), in rank order: what a caller concatenates.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray


class Worker(Protocol):
    dp_rank: int
    tp_rank: int

    def submit(self, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef: ...


def split_evenly(items: Sequence[Any], num_chunks: int) -> list[list[Any]]:
    """Contiguous chunks whose sizes differ by at most one, the larger first: [5 items, 2] -> [3, 2]."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    base, extra = divmod(len(items), num_chunks)
    chunks, start = [], 0
    for i in range(num_chunks):
        size = base + (1 if i < extra else 0)
        chunks.append(list(items[start : start + size]))
        start += size
    return chunks


def route(num_replicas: int, num_controllers: int, rank: int, *, uneven: bool = False) -> list[int]:
    """The replicas (data-parallel ranks) of a service that controller `rank` calls.

    With at least as many replicas as controllers, each controller owns a contiguous block (the replicas must
    divide evenly); with fewer, controllers share replicas round-robin: 4 replicas, 2 controllers, rank 1 ->
    [2, 3]; 1 replica, 2 controllers -> [0] for both. `uneven=True` (after a live move) allows blocks whose
    sizes differ by one, the larger first: 3 replicas, 2 controllers -> [0, 1] and [2].
    """
    if not 0 <= rank < num_controllers:
        raise ValueError(f"rank must be in [0, {num_controllers}), got {rank}")
    if num_replicas >= num_controllers:
        if num_replicas % num_controllers and uneven:
            return split_evenly(range(num_replicas), num_controllers)[rank]
        if num_replicas % num_controllers:
            raise ValueError(
                f"a service with {num_replicas} replicas cannot be split evenly over {num_controllers} controllers"
            )
        block = num_replicas // num_controllers
        return list(range(rank * block, (rank + 1) * block))
    return [rank % num_replicas]


def _send(worker: Worker, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
    return worker.submit(method, args, kwargs)


def broadcast(workers: Sequence[Worker], method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
    return [_send(w, method, args, kwargs) for w in workers]


def scatter(
    workers: Sequence[Worker], method: str, items: Sequence[Any], **kwargs: Any
) -> list[ray.ObjectRef]:
    dp_size = 1 + max(w.dp_rank for w in workers)
    chunks = split_evenly(items, dp_size)
    return [_send(w, method, (chunks[w.dp_rank],), kwargs) for w in workers]


def _num_rows(batch: dict[str, Any]) -> int:
    """B: the row count of the first value that has rows (a list/tuple, or anything with a non-empty shape)."""
    for value in batch.values():
        if isinstance(value, list | tuple):
            return len(value)
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    raise ValueError(f"shard_rows: batch has no row-sliceable value (keys {sorted(batch)})")


def _has_rows(value: Any, num_rows: int) -> bool:
    if isinstance(value, list | tuple):
        return len(value) == num_rows
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) > 0 and int(shape[0]) == num_rows


def split_rows(batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """`num_chunks` contiguous row chunks of a dict batch (sizes as `split_evenly`): values with B rows are
    sliced `v[a:b]`; every other value (scalars, None, lists of another length) goes to every chunk as is."""
    if not isinstance(batch, dict):
        raise ValueError(f"shard_rows: batch must be a dict, got {type(batch).__name__}")
    num_rows = _num_rows(batch)
    if num_rows < num_chunks:
        raise ValueError(
            f"shard_rows: batch has {num_rows} rows, fewer than the {num_chunks} data-parallel ranks"
        )
    sizes = [len(chunk) for chunk in split_evenly(range(num_rows), num_chunks)]
    chunks, start = [], 0
    for size in sizes:
        end = start + size
        chunks.append({k: v[start:end] if _has_rows(v, num_rows) else v for k, v in batch.items()})
        start = end
    return chunks


def shard_rows(
    workers: Sequence[Worker], method: str, batch: dict[str, Any], **kwargs: Any
) -> list[ray.ObjectRef]:
    """Chunk r of `batch` to every worker (all tp peers) of data-parallel rank r; one ref per data-parallel
    rank (its tp_rank-0 worker's), in rank order."""
    dp_size = 1 + max(w.dp_rank for w in workers)
    chunks = split_rows(batch, dp_size)
    refs: list[ray.ObjectRef | None] = [None] * dp_size
    for w in workers:
        ref = _send(w, method, (chunks[w.dp_rank],), kwargs)
        if w.tp_rank == 0:
            refs[w.dp_rank] = ref
    return refs


def to_rank(workers: Sequence[Worker], dp_rank: int, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
    """The same call to every worker (tp peer) of one data-parallel rank; the tp_rank-0 worker's ref."""
    refs = {w.tp_rank: _send(w, method, args, kwargs) for w in workers if w.dp_rank == dp_rank}
    if 0 not in refs:
        raise ValueError(f"no worker of data-parallel rank {dp_rank} with tp_rank 0")
    return refs[0]


def rank_zero(workers: Sequence[Worker], method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
    return [_send(workers[0], method, args, kwargs)]


def gather(workers: Sequence[Worker], refs: Sequence[ray.ObjectRef]) -> list[ray.ObjectRef]:
    if len(refs) != len(workers):
        raise ValueError(f"gather needs one ref per worker: {len(workers)} workers, {len(refs)} refs")
    return [ref for w, ref in zip(workers, refs, strict=True) if w.tp_rank == 0]


DISPATCH: dict[str, Callable[..., list[ray.ObjectRef]]] = {
    "broadcast": broadcast,
    "scatter": scatter,
    "rank_zero": rank_zero,
}


# ref id -> how to send that call again after its worker's process died (`WorkerGroup.call_one` registers;
# `fetch` consumes). Bounded: the oldest entries (refs fetched some other way) are dropped first.
_RESEND: OrderedDict[bytes, Callable[[BaseException], ray.ObjectRef]] = OrderedDict()
MAX_RESENDS = 10_000
MAX_TRIES = 3  # sends of one call: the first and two after replacements


def on_death(ref: ray.ObjectRef, resend: Callable[[BaseException], ray.ObjectRef]) -> None:
    """Register `resend(error)`: called by `fetch` when `ref`'s worker died; returns the ref sent again."""
    _RESEND[ref.binary()] = resend
    while len(_RESEND) > MAX_RESENDS:
        _RESEND.popitem(last=False)


def fetch(refs: ray.ObjectRef | Sequence[ray.ObjectRef], *, timeout: float | None = None) -> Any:
    """`ray.get` of refs (in the driver, `ledger.count_driver_ray_bytes` counts what it receives). A ref whose
    worker's process died is sent again, after its replica is replaced, when its call registered how
    (`on_death`); otherwise the death is raised."""
    single = isinstance(refs, ray.ObjectRef)
    try:
        values = ray.get(refs, timeout=timeout)
    except ray.exceptions.RayActorError:
        values = _again(refs, timeout) if single else [_again(ref, timeout) for ref in refs]
    for ref in [refs] if single else refs:
        _RESEND.pop(ref.binary(), None)
    return values


def _again(ref: ray.ObjectRef, timeout: float | None) -> Any:
    """The value of `ref`, sent again (at most MAX_TRIES sends in all) while its worker dies."""
    for tries in range(1, MAX_TRIES + 1):
        try:
            value = ray.get(ref, timeout=timeout)
            _RESEND.pop(ref.binary(), None)
            return value
        except ray.exceptions.RayActorError as exc:
            resend = _RESEND.pop(ref.binary(), None)
            if resend is None or tries == MAX_TRIES:
                raise
            ref = resend(exc)
    raise AssertionError("unreachable")


class InflightWindow:
    """Bounds outstanding calls: admitting one more than `max_inflight` first waits (`ray.wait`) until one
    finishes. Completed refs are forgotten; results stay with whoever holds the ref."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self._pending: list[ray.ObjectRef] = []
        self.waits = 0  # times admission had to wait: a bounded window is observable

    def admit(self, submit: Callable[[], ray.ObjectRef]) -> ray.ObjectRef:
        if len(self._pending) >= self.max_inflight:
            _, self._pending = ray.wait(self._pending, num_returns=1)
            if self._pending:  # drop whatever else finished meanwhile, without blocking
                _, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            self.waits += 1
        ref = submit()
        self._pending.append(ref)
        return ref

    @property
    def num_pending(self) -> int:
        return len(self._pending)
