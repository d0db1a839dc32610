"""The worker side of `VLLMEngine`'s weight updates: a vLLM worker extension (`worker_extension_cls`) and the
shared-memory segment its buckets travel in when the worker is another process.

vLLM mixes `YattWorkerExtension` into its worker class; the engine reaches its methods by name through
`collective_rpc`, in the engine's process (vLLM's uni-process executor with `VLLM_ENABLE_V1_MULTIPROCESSING=0`:
arguments are passed by reference, so buckets arrive as they are, no copy, no pickling) or in worker
processes (arguments are serialized: then only a segment name and small msgpack headers travel, and the
tensors are views into one `/dev/shm` segment the engine filled, `ShmBuckets`). One RPC per update either way.

The worker's state (the recorded copy plan, the mapped segment) lives in a `WorkerWeights` object held by
the worker as `yatt_weights`. On GPU the same shape holds with CUDA IPC handles or an NCCL broadcast in
place of the segment; neither is implemented here (no GPU to build or test it on).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

from yatt_rollout.buckets import ALIGN, bucket_tensors
from yatt_rollout.types import WeightBucket

EXTENSION = "yatt_rollout.vllm_worker.YattWorkerExtension"


@dataclass
class WorkerWeights:
    """A worker's update state: the copy plan of the last recording and the segment it reads from."""

    plan: Any = None  # vllm_weights.WeightPlan
    # the parameters and their storage when recorded: the plan's views are valid while none moved
    params: list[Any] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    segment: tuple[str, int, mmap.mmap] | None = None  # (name, size, mapping)
    replays: int = 0
    recordings: int = 0

    def load(self, model: Any, pairs: list) -> dict[str, Any]:
        """Replay the plan if it holds for `pairs` and the parameters did not move; else record anew."""
        from yatt_rollout import vllm_weights

        plan = self.plan
        # replay while the plan is complete, knows every tensor, and no parameter's storage moved (a module
        # given a new Parameter object is not seen here: nothing does that after `yatt_prepare_in_place`)
        moved = [p.data_ptr() for p in self.params] != self.ptrs
        if plan is not None and plan.complete and plan.covers(pairs) and not moved:
            nbytes = plan.replay(pairs)
            self.replays += 1
            return {"path": "replay", "bytes": nbytes}
        self.plan = vllm_weights.record(model, pairs)
        self.params = list(model.parameters())
        self.ptrs = [p.data_ptr() for p in self.params]
        self.recordings += 1
        return {"path": "record", "problem": self.plan.problem}

    def view(self, name: str, size: int) -> Any:
        """The shared-memory segment `name` mapped (kept mapped across updates while it stays the same)."""
        if self.segment is None or self.segment[:2] != (name, size):
            if self.segment is not None:
                self.segment[2].close()
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self.segment = (name, size, mmap.mmap(fd, size))
            finally:
                os.close(fd)
        return self.segment[2]


class YattWorkerExtension:
    """Methods vLLM adds to its worker class (`worker_extension_cls`); called through `collective_rpc`."""

    def _yatt(self) -> WorkerWeights:
        state = getattr(self, "yatt_weights", None)
        if state is None:
            state = WorkerWeights()
            self.yatt_weights = state
        return state

    def yatt_pid(self) -> int:
        """The worker's process id: the engine passes buckets by reference when it is its own."""
        return os.getpid()

    def yatt_prepare_in_place(self) -> int:
        """Give packed CPU linears their plain weights back and load them from the model's checkpoint, so
        every later update can land by copies into live parameters; returns the number of layers changed."""
        from vllm.model_executor.model_loader import get_model_loader

        from yatt_rollout.vllm_weights import plain_linears

        model = self.get_model()  # type: ignore[attr-defined]
        changed = plain_linears(model)
        if changed:
            config = self.vllm_config  # type: ignore[attr-defined]
            loader = get_model_loader(config.load_config)
            if not hasattr(loader, "get_all_weights"):  # vLLM's reload_weights has the same requirement
                fmt = config.load_config.load_format
                raise ValueError(f"in_place_weights cannot reload {fmt!r} checkpoints")
            model.load_weights(loader.get_all_weights(config.model_config, model))
        return changed

    def yatt_load(self, buckets: list[WeightBucket]) -> dict[str, Any]:
        """Load buckets passed by reference (the worker is the engine's process)."""
        pairs = [pair for bucket in buckets for pair in bucket_tensors(bucket)]
        return self._yatt().load(self.get_model(), pairs)  # type: ignore[attr-defined]

    def yatt_load_shm(self, name: str, size: int, headers: bytes) -> dict[str, Any]:
        """Load buckets laid in shared-memory segment `name` as `ShmBuckets.fill` described them."""
        from yatt_rollout.vllm_weights import tensors_of

        state = self._yatt()
        pairs = tensors_of(msgspec.msgpack.decode(headers), state.view(name, size))
        return state.load(self.get_model(), pairs)  # type: ignore[attr-defined]

    def yatt_weight_stats(self) -> dict[str, Any]:
        """How updates have landed so far: recordings, replays and why the plan is incomplete (if it is)."""
        state = self._yatt()
        problem = "not recorded yet" if state.plan is None else state.plan.problem
        return {"recordings": state.recordings, "replays": state.replays, "problem": problem}


class ShmBuckets:
    """One `/dev/shm` segment the engine lays buckets into for worker processes; grown when an update needs
    more room, unlinked by `close`."""

    def __init__(self) -> None:
        self.shm: Any = None  # multiprocessing.shared_memory.SharedMemory

    def fill(self, buckets: list[WeightBucket]) -> tuple[str, int, bytes]:
        """Copy the buckets' data into the segment: (segment name, its size, msgpack headers)."""
        from multiprocessing import shared_memory

        import numpy as np

        headers, starts, total = [], [], 0
        for bucket in buckets:
            starts.append(total)
            total += -(-len(bucket.data) // ALIGN) * ALIGN
        if self.shm is None or self.shm.size < total:
            self.close()
            self.shm = shared_memory.SharedMemory(create=True, size=max(total, ALIGN))
        flat = np.frombuffer(self.shm.buf, dtype=np.uint8)
        for bucket, start in zip(buckets, starts, strict=True):
            data = np.frombuffer(bucket.data, dtype=np.uint8)
            flat[start : start + len(data)] = data
            headers.append(
                {
                    "dtype": bucket.dtype,
                    "start": start,
                    "names": bucket.names,
                    "shapes": bucket.shapes,
                    "offsets": bucket.offsets,
                }
            )
        del flat  # no export of the segment's buffer may outlive this call (close() would refuse)
        return self.shm.name, self.shm.size, msgspec.msgpack.encode(headers)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None
