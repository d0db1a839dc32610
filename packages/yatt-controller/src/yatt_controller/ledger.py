"""Byte accounting: how many payload bytes pass through the driver process.

The parallel-controller claim is that no sample passes through the driver. Rather than trust that, every
data movement the runtime performs in a process (dispatch arguments that are not object refs, results fetched
with `fetch`) is measured here, and the driver reports its own total. Sizes are payload sizes (buffers,
strings, arrays, tensors), measured without serialising: the accounting must not cost a copy itself.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

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

    Only a ledger that is `active` counts: the driver activates its own; controller actors leave theirs off,
    since bytes moving between a controller and a service are the point, not a cost to the driver.
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


# One per process: a Ray actor is a process, so the driver's ledger is never the controllers'.
LEDGER = ByteLedger()
