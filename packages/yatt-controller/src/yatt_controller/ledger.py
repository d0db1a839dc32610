"""Byte accounting: how many payload bytes pass through the driver process.

The parallel-controller claim is that no sample passes through the driver. Rather than trust that (or count
only what one module sends), `count_driver_ray_bytes()` wraps Ray's own API in the driver for the duration of
a run: the arguments of every remote call (actor methods, remote functions, actor constructors), every
`ray.put`, and every value `ray.get` returns, whoever calls it (the runtime, a step function running in the
driver, a library). `ray.wait` moves no data and is free. Sizes are payload sizes (buffers, strings, arrays,
tensors), measured without serialising: the accounting must not cost a copy itself; object refs count 0 (the
bytes move when someone fetches them, and are counted there if it is the driver). The driver is never a
host process, so it makes no calls in process (`local_calls`): all it moves goes through Ray.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

SCALAR_BYTES = 8  # a number or None on the wire: a fixed, small charge


def payload_nbytes(obj: object) -> int:
    """Bytes of payload in `obj`, recursively: buffers by length, arrays/tensors by `nbytes`, strings by
    UTF-8 length, containers and msgspec Structs by their contents. Object refs count 0 (a ref is a handle;
    its bytes do not move until fetched)."""
    if obj is None or isinstance(obj, bool | int | float):
        return SCALAR_BYTES
    if isinstance(obj, bytes | bytearray):
        return len(obj)
    if isinstance(obj, memoryview):
        return obj.nbytes
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, Mapping):
        return sum(payload_nbytes(k) + payload_nbytes(v) for k, v in obj.items())
    if isinstance(obj, list | tuple | set | frozenset):
        return sum(payload_nbytes(item) for item in obj)
    if isinstance(obj, msgspec.Struct):
        return sum(payload_nbytes(getattr(obj, field)) for field in obj.__struct_fields__)
    if type(obj).__name__ == "ObjectRef":
        return 0
    nbytes = getattr(obj, "nbytes", None)  # numpy arrays and torch tensors, without importing either
    if isinstance(nbytes, int):
        return nbytes
    return SCALAR_BYTES


class ByteLedger:
    """Counts payload bytes that one process sends and receives through the runtime. Thread-safe.

    Only a ledger that is `active` counts (`count_driver_ray_bytes` activates the one it yields).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = False
        self.sent = 0
        self.received = 0

    def count_sent(self, obj: object) -> None:
        if self.active:
            n = payload_nbytes(obj)
            with self._lock:
                self.sent += n

    def count_received(self, obj: object) -> None:
        if self.active:
            n = payload_nbytes(obj)
            with self._lock:
                self.received += n

    @property
    def total(self) -> int:
        return self.sent + self.received

    def reset(self) -> None:
        with self._lock:
            self.sent = self.received = 0


def _remote_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """The (args, kwargs) a `_remote(self, args=None, kwargs=None, **options)` call submits."""
    call_args = kwargs["args"] if "args" in kwargs else (args[0] if args else None)
    call_kwargs = kwargs["kwargs"] if "kwargs" in kwargs else (args[1] if len(args) > 1 else None)
    return call_args or (), call_kwargs or {}


@contextlib.contextmanager
def count_driver_ray_bytes() -> Iterator[ByteLedger]:
    """Count every payload byte this process sends or receives through Ray while the block runs: patches
    `ray.get`, `ray.put`, `ActorMethod._remote`, `ActorClass._remote` and `RemoteFunction._remote` (every
    `.remote(...)` and `.options(...).remote(...)` goes through one of them), restored on exit even on error.
    Not reentrant across threads: one run at a time per process."""
    import ray
    import ray.actor
    import ray.remote_function

    ledger = ByteLedger()
    ledger.active = True
    depth = threading.local()  # a _remote that calls _remote (get_if_exists retries) counts once

    def submitting(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(depth, "n", 0) == 0
            if outer:
                ledger.count_sent(_remote_args(args, kwargs))
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth.n -= 1

        return wrapper

    original_get, original_put = ray.get, ray.put

    @functools.wraps(original_get)
    def get(*args: Any, **kwargs: Any) -> Any:
        values = original_get(*args, **kwargs)
        ledger.count_received(values)
        return values

    @functools.wraps(original_put)
    def put(value: Any, *args: Any, **kwargs: Any) -> Any:
        ledger.count_sent(value)
        return original_put(value, *args, **kwargs)

    owners: list[Any] = [ray.actor.ActorMethod, ray.actor.ActorClass, ray.remote_function.RemoteFunction]
    saved = [(owner, owner.__dict__["_remote"]) for owner in owners]
    try:
        ray.get, ray.put = get, put
        for owner, original in saved:
            owner._remote = submitting(original)
        yield ledger
    finally:
        ray.get, ray.put = original_get, original_put
        for owner, original in saved:
            owner._remote = original
        ledger.active = False
