"""Weight-sync orchestration: who sends to whom, and the version the weights carry. Imports no torch.

`WeightSync` ties a trainer group (the source) to engine groups (the targets). "broadcast" (disaggregated):
the source's rank 0 and every target worker form one broadcast group, set up once; each push ships the
trainer's weights in dtype buckets (`yatt_controller.weight_sync`). "colocated": each target worker loads from
the source worker in its own host process. Every push carries a `version`, which the targets record and stamp
on what they produce; controllers refuse samples of another version (`check_versions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import ray

from yatt_controller.worker_group import Worker, WorkerGroup

SyncMode = Literal["broadcast", "colocated"]


class StaleSampleError(ValueError):
    """A step was about to train on samples made by weights of an unexpected version."""


def check_versions(versions: Sequence[int], expected: int, *, max_staleness: int = 0) -> None:
    """Raise unless every sample's version is in [expected - max_staleness, expected]."""
    bad = sorted({v for v in versions if not expected - max_staleness <= v <= expected})
    if bad:
        raise StaleSampleError(
            f"samples of policy versions {bad} in a step that expects version {expected} "
            f"(max_staleness {max_staleness}); refusing to train on them"
        )


class WeightSync:
    """Pushes a trainer group's weights to engine groups. Build it in the driver, `setup()` once, then any
    controller (rank 0 in parallel mode) calls `push(version)`; it travels to controllers by pickling."""

    def __init__(
        self,
        source: WorkerGroup,
        targets: Sequence[WorkerGroup],
        *,
        mode: SyncMode = "broadcast",
        backend: str = "gloo",
        bucket_bytes: int = 64 * 2**20,
        group: str = "yatt-weights",
    ) -> None:
        if mode not in ("broadcast", "colocated"):
            raise ValueError(f"WeightSync mode must be 'broadcast' or 'colocated', got {mode!r}")
        if not targets:
            raise ValueError("WeightSync needs at least one target group")
        self.source, self.targets, self.mode = source, list(targets), mode
        self.backend, self.bucket_bytes, self.group = backend, bucket_bytes, group
        self.target_workers: list[Worker] = [w for g in self.targets for w in g.workers]
        self.pairs: list[tuple[Worker, Worker]] = []
        if mode == "colocated":
            self.pairs = [(self._source_on(w.device), w) for w in self.target_workers]

    def _source_on(self, device: int) -> Worker:
        for worker in self.source.workers:
            if worker.device == device:
                return worker
        raise ValueError(
            f"colocated weight sync: no {self.source.role!r} worker on device {device}, "
            "where a target worker runs; use mode='broadcast' for disaggregated roles"
        )

    def setup(self) -> None:
        """Form the broadcast group: source rank 0 is rank 0, target workers follow in order."""
        if self.mode != "broadcast":
            return
        sender = self.source.workers[0]
        shared = [w.label for w in self.target_workers if w.host == sender.host]
        if shared:
            raise ValueError(
                f"broadcast weight sync: {shared} share the sender's process; use mode='colocated'"
            )
        addr, port = ray.get(sender.host.sync_open.remote(self.group))
        world = 1 + len(self.target_workers)
        members = [sender, *self.target_workers]
        ray.get(
            [
                w.host.sync_join.remote(self.group, addr, port, rank, world, self.backend)
                for rank, w in enumerate(members)
            ]
        )

    def push(self, version: int) -> int:
        """Ship the current weights as `version`; returns after every target loaded them. Bytes sent."""
        if self.mode == "colocated":
            return sum(
                ray.get([dst.host.sync_local.remote(src.key, dst.key, version) for src, dst in self.pairs])
            )
        sender = self.source.workers[0]
        buckets = ray.get(sender.host.sync_plan.remote(sender.key, self.bucket_bytes))
        sent = sender.host.sync_send.remote(self.group, sender.key, buckets)
        received = [w.host.sync_recv.remote(self.group, w.key, buckets, version) for w in self.target_workers]
        ray.get(received)
        return ray.get(sent)
