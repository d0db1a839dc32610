"""Weight-sync orchestration: who sends to whom, and the version the weights carry. Imports no torch.

`WeightSync` ties a trainer group (the source) to engine groups (the targets). "auto" (default, any layout):
targets in a source worker's process copy in process, the others receive the broadcast. "broadcast" (disaggregated):
the source's rank 0 and every target worker form one broadcast group, set up once; each push ships the
trainer's weights in dtype buckets (`yatt_controller.weight_sync`). "colocated": each target worker loads from
the source worker in its own host process. Every push carries a `version`, which the targets record and stamp
on what they produce; controllers refuse samples of another version (`check_versions`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray

from yatt_controller import local_calls
from yatt_controller.worker_group import Worker, WorkerGroup

SyncMode = Literal["auto", "broadcast", "colocated"]


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


@dataclass
class _Pending:
    """A push under way (`WeightSync.start`): the in-process copies, the broadcast's send (None without one),
    the remote hosts' receive-and-load calls, and the bytes of an earlier push it settled first."""

    local: list
    sent: Any
    received: list
    carried: int = 0


class WeightSync:
    """Pushes a trainer group's weights to engine groups. Build it in the driver, `setup()` once, then any
    controller (rank 0 in parallel mode) calls `push(version)`; it travels to controllers by pickling.

    "auto" (the default) serves any layout in one push: a target worker whose host process also hosts a
    source worker loads from THAT worker in process (`sync_local`); every other target host receives the
    broadcast of source rank 0. "colocated" requires every target to have a source worker on its device;
    "broadcast" requires none to share the sender's process. Target workers that share one host process join
    the broadcast group once (one rank per process) and all load what it received."""

    def __init__(
        self,
        source: WorkerGroup,
        targets: Sequence[WorkerGroup],
        *,
        mode: SyncMode = "auto",
        backend: str = "gloo",
        bucket_bytes: int = 64 * 2**20,
        group: str = "yatt-weights",
    ) -> None:
        if mode not in ("auto", "broadcast", "colocated"):
            raise ValueError(f"WeightSync mode must be 'auto', 'broadcast' or 'colocated', got {mode!r}")
        self.source, self.mode = source, mode
        self.backend, self.bucket_bytes, self.group = backend, bucket_bytes, group
        self.generation = 0  # bumped by every retarget: each target set gets a broadcast group of its own
        self.group_name = ""  # the formed broadcast group ("" when no target is remote)
        self.last_local_bytes = self.last_broadcast_bytes = 0
        # the host process of the controller holding this copy (`Controller.hosted_by`): its pushes there run
        # in process (`local_calls`)
        self.here: local_calls.Here | None = None
        self._pending: _Pending | None = None  # a push started and not yet settled (this process's)
        self._settling = threading.Lock()
        self._assign(targets)

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (a controller) has no push under way: refs stay where they were made."""
        state = dict(self.__dict__)
        state["_pending"], state["_settling"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._settling = threading.Lock()

    def _assign(self, targets: Sequence[WorkerGroup]) -> None:
        """Split the target workers into in-process pairs and remote host processes."""
        if not targets:
            raise ValueError("WeightSync needs at least one target group")
        self.targets = list(targets)
        self.target_workers: list[Worker] = [w for g in self.targets for w in g.workers]
        self.pairs: list[tuple[Worker, Worker]] = []  # (source worker, target worker) in one process
        remote: list[Worker] = []
        if self.mode == "colocated":
            self.pairs = [(self._source_on(w.device), w) for w in self.target_workers]
        elif self.mode == "auto":
            in_host: dict[Any, Worker] = {}
            for worker in self.source.workers:
                in_host.setdefault(worker.host, worker)
            for w in self.target_workers:
                if w.host in in_host:
                    self.pairs.append((in_host[w.host], w))
                else:
                    remote.append(w)
        else:
            remote = list(self.target_workers)
        # one broadcast rank per remote host process, holding the keys of every target worker it hosts
        self.remote: list[tuple[Any, list[str], list[str]]] = []  # (host, keys, labels)
        for w in remote:
            entry = next((e for e in self.remote if e[0] == w.host), None)
            if entry is None:
                entry = (w.host, [], [])
                self.remote.append(entry)
            entry[1].append(w.key)
            entry[2].append(w.label)

    def _source_on(self, device: int) -> Worker:
        for worker in self.source.workers:
            if worker.device == device:
                return worker
        raise ValueError(
            f"colocated weight sync: no {self.source.role!r} worker on device {device}, "
            "where a target worker runs; use mode='broadcast' for disaggregated roles"
        )

    def setup(self) -> None:
        """Form the broadcast group (source rank 0 is rank 0, remote target hosts follow in order); none when
        every target loads in process."""
        self.group_name = ""
        if not self.remote:
            return
        sender = self.source.workers[0]
        if self.mode == "broadcast":
            shared = [label for host, _, labels in self.remote if host == sender.host for label in labels]
            if shared:
                raise ValueError(
                    f"broadcast weight sync: {shared} share the sender's process; use mode='colocated'"
                )
        name = self.group if self.generation == 0 else f"{self.group}-{self.generation}"
        addr, port = ray.get(sender.host.sync_open.remote(name))
        hosts = [sender.host, *(host for host, _, _ in self.remote)]
        world = len(hosts)
        ray.get(
            [h.sync_join.remote(name, addr, port, rank, world, self.backend) for rank, h in enumerate(hosts)]
        )
        self.group_name = name

    def retarget(self, targets: Sequence[WorkerGroup]) -> None:
        """Serve a new target set (replicas moved): re-split local and remote and form a fresh broadcast group
        (`{group}-{generation}`) from the sender and the new remote hosts. The caller pushes next."""
        self.settle()  # a push under way finishes on the old group first (its bytes count in no step)
        old = self.group_name
        self.generation += 1
        self._assign(targets)
        if old:  # the sender's end of the old group; moved receivers took theirs down with their process
            ray.get(self.source.workers[0].host.sync_close.remote(old))
        self.setup()

    def push(self, version: int, *, sources: Collection[str] | None = None) -> int:
        """Ship the current weights as `version`; returns after every target loaded them. Returns the bytes
        moved: in-process copies plus the bytes each remote host received (`last_local_bytes`,
        `last_broadcast_bytes`).

        `sources` (labels of source workers): only the in-process pairs whose source is one of them, and no
        broadcast: a controller's share of a pairwise push, where each controller loads the targets beside
        its own learner ranks (full colocation whose sources all hold the same weights, DDP). Every pair
        belongs to one controller's sources, so the controllers' shares together are the whole push."""
        self.start(version, sources=sources)
        return self.settle()

    def start(self, version: int, *, sources: Collection[str] | None = None) -> None:
        """`push` without the wait: the in-process copies, the broadcast's send and the targets' loads are
        under way when it returns, and `settle()` waits for them. Until then the caller neither changes the
        sources' weights nor uses the targets (the sender reads the live weights while it sends; a target
        loads when it has received). A push still under way is settled first (its bytes count in the next
        `settle()`)."""
        with self._settling:
            carried = self._settle()
            pairs = self.pairs if sources is None else [(s, d) for s, d in self.pairs if s.label in sources]
            local = [
                local_calls.call(self.here, dst.host, "sync_local", src.key, dst.key, version)
                for src, dst in pairs
            ]
            # pending from here on: should the broadcast fail to start, the next settle still waits for the
            # copies under way and returns the bytes carried
            self._pending = pending = _Pending(local, None, [], carried)
            if self.remote and sources is None:
                if not self.group_name:
                    raise ValueError(
                        "WeightSync.push: remote targets but no broadcast group; call setup() first"
                    )
                sender = self.source.workers[0]
                buckets = local_calls.get(
                    local_calls.call(self.here, sender.host, "sync_plan", sender.key, self.bucket_bytes)
                )
                pending.sent = local_calls.call(
                    self.here, sender.host, "sync_send", self.group_name, sender.key, buckets
                )
                pending.received = [
                    host.sync_recv.remote(self.group_name, keys, buckets, version)
                    for host, keys, _ in self.remote
                ]

    def settle(self) -> int:
        """Wait for the push `start` began (nothing to wait for: 0); returns its bytes as `push` does. A push
        that failed raises here, once."""
        with self._settling:
            return self._settle()

    @property
    def pending(self) -> bool:
        """Whether a push was started and not settled yet."""
        return self._pending is not None

    def _settle(self) -> int:
        pending, self._pending = self._pending, None
        if pending is None:
            return 0
        if pending.sent is not None:
            local_calls.get(pending.sent)
        self.last_local_bytes = sum(local_calls.get(pending.local))
        self.last_broadcast_bytes = sum(ray.get(pending.received))
        return pending.carried + self.last_local_bytes + self.last_broadcast_bytes
