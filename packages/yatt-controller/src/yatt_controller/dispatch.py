"""Explicit dispatch: how one call on a worker group becomes calls on its workers.

A worker group is a list of workers, each with a data-parallel rank (`dp_rank`) and a rank inside its
model-parallel group (`tp_rank`). Every dispatch function returns object refs, in worker order; only a
controller turns refs into values (its `Dispatcher.fetch`), and the in-flight window bounds how much work is outstanding.

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

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray

from yatt_controller import local_calls


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
    refs: dict[int, ray.ObjectRef] = {}
    for w in workers:
        ref = _send(w, method, (chunks[w.dp_rank],), kwargs)
        if w.tp_rank == 0:
            refs[w.dp_rank] = ref
    return [refs[rank] for rank in range(dp_size)]


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


MAX_RESENDS = 10_000  # calls remembered per controller; the oldest (fetched some other way) go first
MAX_TRIES = 3  # sends of one call: the first and two after replacements


class Dispatcher:
    """One controller's fetching of results: the resend map of its replaceable calls, held by the controller
    (`ctx.get` fetches through it), never by the module. `WorkerGroup.call_one` on a view whose traffic has
    this dispatcher registers how to send the call again (`track`); `fetch` resends a call whose worker's
    process died after `repair(view, dp_rank, error)` replaced the replica (it re-raises `error` when the
    replica may not be replaced). Thread-safe: an async producer's threads call services too."""

    def __init__(self, repair: Callable[[Any, int, BaseException], None] | None = None) -> None:
        self.repair = repair
        self._resend: OrderedDict[bytes, Callable[[BaseException], ray.ObjectRef]] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple:
        return (Dispatcher, ())  # a resend map belongs to the process that sent the calls

    def track(
        self, group: Any, rank: int, ref: ray.ObjectRef, method: str, args: tuple, kwargs: dict
    ) -> None:
        """Remember how to send `group.call_one(method, ...)` (sent to dp rank `rank`) again."""
        if self.repair is None:
            return
        repair = self.repair

        def resend(error: BaseException) -> ray.ObjectRef:
            repair(group, rank, error)  # re-raises `error` when the replica cannot be replaced
            return group.call_one(method, *args, **kwargs)

        with self._lock:
            self._resend[ref.binary()] = resend
            while len(self._resend) > MAX_RESENDS:
                self._resend.popitem(last=False)

    def _pop(self, ref: ray.ObjectRef) -> Callable[[BaseException], ray.ObjectRef] | None:
        with self._lock:
            return self._resend.pop(ref.binary(), None)

    def fetch(self, refs: Any, *, timeout: float | None = None) -> Any:
        """`ray.get` of one ref or a list of refs. A ref whose worker's process died is sent again, after its
        replica is replaced, when its call was tracked; otherwise the death is raised."""
        single = isinstance(refs, ray.ObjectRef | local_calls.LocalRef)
        listed: list[ray.ObjectRef] = [refs] if single else list(refs)
        try:
            values = local_calls.get(refs, timeout=timeout)  # a call in process is one `LocalRef`
        except ray.exceptions.RayActorError:
            again = [self._again(ref, timeout) for ref in listed]
            values = again[0] if single else again
        for ref in listed:
            self._pop(ref)
        return values

    def _again(self, ref: ray.ObjectRef, timeout: float | None) -> Any:
        """The value of `ref`, sent again (at most MAX_TRIES sends in all) while its worker dies."""
        for tries in range(1, MAX_TRIES + 1):
            try:
                value = local_calls.get(ref, timeout=timeout)
                self._pop(ref)
                return value
            except ray.exceptions.RayActorError as exc:
                resend = self._pop(ref)
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
            _, self._pending = local_calls.wait(self._pending, num_returns=1)
            if self._pending:  # drop whatever else finished meanwhile, without blocking
                _, self._pending = local_calls.wait(self._pending, num_returns=len(self._pending), timeout=0)
            self.waits += 1
        ref = submit()
        self._pending.append(ref)
        return ref

    @property
    def num_pending(self) -> int:
        return len(self._pending)


class Traffic:
    """One worker group view's calls in this process: its in-flight window, `call_one`'s count of unfinished
    calls per data-parallel rank (least-loaded choice, ties round-robin), and the controller's `Dispatcher`
    when the view's replicas may be replaced. Pickles as a fresh, empty one (pending refs and the resend map
    stay with the process that made them); the workers of a view share its one instance."""

    def __init__(self, max_inflight: int, dispatcher: Dispatcher | None = None) -> None:
        self.window = InflightWindow(max_inflight)
        self.dispatcher = dispatcher
        # the host process its controller lives in (`local_calls.Here`): its workers there are called in process
        self.here: local_calls.Here | None = None
        self._outstanding: dict[int, list[ray.ObjectRef]] = {}  # dp rank -> call_one refs not seen done
        self._next_rank = 0
        self._choosing = threading.Lock()

    def __reduce__(self) -> tuple:
        return (Traffic, (self.window.max_inflight,))

    def least_loaded(self, size: int, send: Callable[[int], ray.ObjectRef]) -> tuple[int, ray.ObjectRef]:
        """`send(rank)` to the rank of [0, size) with the fewest unfinished calls; (rank, its ref)."""
        with self._choosing:  # shared by every thread calling this view
            for rank, refs in self._outstanding.items():
                if refs:
                    _, self._outstanding[rank] = local_calls.wait(refs, num_returns=len(refs), timeout=0)
            order = [(self._next_rank + i) % size for i in range(size)]
            rank = min(order, key=lambda r: len(self._outstanding.get(r, ())))  # min keeps the first of ties
            self._next_rank = (rank + 1) % size
            ref = send(rank)
            self._outstanding.setdefault(rank, []).append(ref)
        return rank, ref
