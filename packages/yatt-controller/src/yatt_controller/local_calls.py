"""Calls a process makes to the roles it hosts itself, run in process instead of through Ray.

A controller hosted in a device's process (full colocation: its learner rank, rollout engine and rule reward
live there too) reaches those roles through `Worker.submit`, like any other worker. Through Ray that call is a
task the process sends itself: its arguments pickled, a round trip through Ray's task machinery, its result
stored and fetched again. That costs about 1 ms on an idle machine and 3 ms in the tiny GRPO job's step on 2
cores, where every step makes four or five such calls. Here the same call (`_Host.call`, under the same lock
group) runs on one of the host's own threads and hands back a `LocalRef`: arguments and result pass by
reference, nothing is pickled, nothing leaves the process.

A `LocalRef` stands where an object ref stands. `get` and `wait` take lists that mix both kinds, with
`ray.get` and `ray.wait`'s meaning; the controller's `Dispatcher`, the in-flight window and `run_stream`
use them. An error raised by the call is raised as it is (Ray would wrap it in a RayTaskError). A local call
never meets a dead worker: its process is the caller's.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

_POLL_S = 0.001  # a wait over both kinds looks at each this often (Ray's wait counts whole milliseconds)


class LocalRef:
    """The pending result of a call run in this process (a future), where an object ref would stand."""

    __slots__ = ("fetched", "future", "what")

    def __init__(self, future: concurrent.futures.Future, what: str) -> None:
        self.future, self.what, self.fetched = future, what, False

    def __del__(self) -> None:
        # as Ray logs an object ref's error that nobody fetched (a tp peer's, whose ref `to_rank` drops)
        future = self.future
        if not self.fetched and future.done() and not future.cancelled() and future.exception() is not None:
            print(
                f"a call in process failed and its result was never fetched: {self.what}: "
                f"{future.exception()!r}",
                file=sys.stderr,
            )

    def __repr__(self) -> str:
        return f"LocalRef({self.what}, {'done' if self.future.done() else 'running'})"

    def binary(self) -> bytes:
        """A key unique among live refs (object refs have `binary()` too)."""
        return b"local-%d" % id(self)


@dataclass(frozen=True)
class Here:
    """A host process's own host object (a `worker_group._Host`) and its Ray actor id: what a controller
    hosted there holds (`Controller.hosted_by`, set on its views' `Traffic` and its `WeightSync`) to run its
    calls to that process in process."""

    actor_id: str
    host: Any

    def __reduce__(self) -> tuple:
        return (_nowhere, ())  # a process's own host means nothing in another process

    def host_of(self, handle: Any) -> Any:
        """The host object behind actor handle `handle` when that actor is this process; else None."""
        actor_id = getattr(handle, "_actor_id", None)
        return self.host if actor_id is not None and actor_id.hex() == self.actor_id else None


def _nowhere() -> None:
    return None


def call(here: Here | None, handle: Any, method: str, *args: Any) -> Any:
    """`handle.method.remote(*args)` for a host actor's method, run in process when `here` is that host."""
    host = None if here is None else here.host_of(handle)
    return host.call_here(method, *args) if host is not None else getattr(handle, method).remote(*args)


def is_local(ref: Any) -> bool:
    return isinstance(ref, LocalRef)


def get(refs: Any, *, timeout: float | None = None) -> Any:
    """`ray.get` of one ref or a list of refs, either kind."""
    if isinstance(refs, LocalRef):
        return _result(refs, timeout)
    if isinstance(refs, ray.ObjectRef):
        return ray.get(refs, timeout=timeout)
    listed = list(refs)
    remote = [ref for ref in listed if not isinstance(ref, LocalRef)]
    if len(remote) == len(listed):
        return ray.get(listed, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    values = iter(ray.get(remote, timeout=timeout) if remote else [])
    return [_result(ref, _left(deadline)) if isinstance(ref, LocalRef) else next(values) for ref in listed]


def wait(
    refs: Sequence[Any], *, num_returns: int = 1, timeout: float | None = None
) -> tuple[list[Any], list[Any]]:
    """`ray.wait` over refs of either kind: (the first `num_returns` done, in the order given; the rest)."""
    listed = list(refs)
    local = [ref for ref in listed if isinstance(ref, LocalRef)]
    if not local:
        return ray.wait(listed, num_returns=num_returns, timeout=timeout)
    if not 1 <= num_returns <= len(listed):
        raise ValueError(f"wait: num_returns must be in [1, {len(listed)}], got {num_returns}")
    remote = [ref for ref in listed if not isinstance(ref, LocalRef)]
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done_remote = ray.wait(remote, num_returns=len(remote), timeout=0)[0] if remote else []
        done = {_key(ref) for ref in local if ref.future.done()} | {_key(ref) for ref in done_remote}
        ready = [ref for ref in listed if _key(ref) in done][:num_returns]
        left = _left(deadline)
        if len(ready) >= num_returns or left == 0.0:
            picked = {_key(ref) for ref in ready}
            return ready, [ref for ref in listed if _key(ref) not in picked]
        running = [ref.future for ref in local if not ref.future.done()]
        pending = [ref for ref in remote if _key(ref) not in done]
        if running and pending:  # both kinds still running: block on Ray's a millisecond at a time (its
            # shortest timeout), then look at the local ones
            ray.wait(pending, num_returns=1, timeout=_shortest(left, _POLL_S))
        elif pending:
            ray.wait(pending, num_returns=1, timeout=left)
        else:
            concurrent.futures.wait(running, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)


def _key(ref: Any) -> bytes:
    return ref.binary()  # a LocalRef's is its identity; an object ref's its id (a copy has the same)


def _result(ref: LocalRef, timeout: float | None) -> Any:
    ref.fetched = True
    try:
        value = ref.future.result(timeout=timeout)
    except concurrent.futures.TimeoutError as exc:
        if ref.future.done():  # the call's own TimeoutError (a socket's...), not the wait's
            raise
        raise ray.exceptions.GetTimeoutError(f"{ref.what}: no result within {timeout}s") from exc
    return value


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _shortest(left: float | None, poll: float) -> float:
    return poll if left is None else min(left, poll)
