"""Replica faults survived without a restart: a dead service host is replaced on its device, mid-step.

A service call made with `WorkerGroup.call_one` (rollout, judge, reward replicas) registers how to send it
again (`dispatch.fetch` keeps the registry). When fetching its result finds the replica's host process dead,
the controller that fetched repairs it here and sends the call again, so the step goes on; seeded requests
carry their seeds, so the result equals an uninterrupted run's.

A repair is per dead host, once for the whole run (the attempt's `Repairs` actor grants it to the first
controller that asks; the others wait for it and adopt its result): every replica that had a worker on the
dead host is started again on the same devices (surviving tensor-parallel peers are dropped first: their
group is broken), on a fresh host process where the dead one was; replicas the weight sync feeds get the
CURRENT weights from this controller's own learner rank (a one-off broadcast group) before any call reaches
them. Rank 0 re-forms the run's broadcast group before its next push (`heal_sync`), and every controller
adopts new repairs at the start of each step, so no call is routed to a dead host twice. The driver's health
monitor does not fail the attempt for such a host while its repair is due.

Only hosts that hold no learner rank and no checkpointed group can be replaced (in colocated and partial
layouts a rollout replica shares a learner's process: its death is a learner death and restarts the run from
its checkpoint, as do controller deaths).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from yatt_controller.worker_group import HostPool, HostRecord, Worker, WorkerGroup, start_replica


def host_id(handle: Any) -> str:
    """A host actor's id (hex): how a dead process is named across controllers and the driver."""
    return handle._actor_id.hex()


def frozen_hosts(groups: Mapping[str, WorkerGroup], frozen: Iterable[str]) -> set[str]:
    """Ids of the hosts that hold a worker of a `frozen` group (the learner, checkpointed groups)."""
    return {host_id(w.host) for name in frozen if name in groups for w in groups[name].workers}


@dataclass
class Repair:
    """One dead host replaced: its device(s), the new host records and the new workers per group name."""

    dead: str  # the dead host's id
    hosts: list[HostRecord]
    workers: dict[str, list[Worker]]  # group name -> the restarted replicas' workers (group dp ranks)
    replicas: int  # replicas started again


class RepairBook:
    """The attempt's record of repairs (hosted as the `Repairs` actor): grants each dead host's repair to one
    controller at a time, and keeps what every repair made."""

    def __init__(self) -> None:
        self._active: str | None = None
        self._since = 0.0
        self._done: list[Repair] = []

    def claim(self, dead: str) -> tuple[str, Any]:
        """("done", the repair) if `dead` was replaced; ("mine", hosts made by repairs so far) to the caller
        that may repair it now; ("wait", None) while another repair runs."""
        for repair in self._done:
            if repair.dead == dead:
                return "done", repair
        if self._active is not None:
            return "wait", None
        self._active, self._since = dead, time.time()
        return "mine", [h for r in self._done for h in r.hosts]

    def finish(self, repair: Repair) -> None:
        self._done.append(repair)
        self._active = None

    def abandon(self, dead: str) -> None:
        if self._active == dead:
            self._active = None

    def log(self, start: int = 0) -> list[Repair]:
        """Repairs from index `start` on, in order."""
        return self._done[start:]

    def replaced(self) -> int:
        """Replicas replaced so far in this attempt (`faults/replicas_replaced`)."""
        return sum(r.replicas for r in self._done)

    def pending(self) -> str | None:
        return self._active


Repairs = ray.remote(num_cpus=0)(RepairBook)


def swap_workers(group: WorkerGroup, name: str, repair: Repair) -> bool:
    """Swap, in place, the workers of `group` (a view or a whole group) that sat in the replicas `repair`
    restarted for its `name`, keeping the view's dp rank and window. Idempotent; True if any changed."""
    new = {(w.group_dp_rank, w.tp_rank): w for w in repair.workers.get(name, [])}
    changed, out = False, []
    for w in group.workers:
        fresh = new.get((w.group_dp_rank, w.tp_rank))
        if fresh is not None and host_id(fresh.host) != host_id(w.host):
            w = Worker(**{**fresh.__dict__, "dp_rank": w.dp_rank, "window": w.window})
            changed = True
        out.append(w)
    group.workers = out
    return changed


def _replicas_on(group: WorkerGroup, dead: str) -> list[int]:
    """Group dp ranks with a worker on the dead host."""
    return sorted({w.group_dp_rank for w in group.workers if host_id(w.host) == dead})


@dataclass
class Healer:
    """One controller's side: repairs on demand, adoption of others' repairs, and the sync's re-forming."""

    repairs: Any  # the Repairs actor handle
    pool: HostPool  # this controller's copy of the driver's pool (the driver's own in single mode)
    groups: dict[str, WorkerGroup]  # the whole groups (plan.full_groups): what a dead host held
    views: dict[str, WorkerGroup]  # this controller's routed views (ctx.services)
    frozen: set[str]  # hosts holding a learner rank or a checkpointed group: never replaced here
    learner: WorkerGroup | None  # this controller's own learner ranks: the weights' source
    weight_sync: Any = None
    version: Callable[[], int] = lambda: 0  # the current policy version (what a restarted replica loads)
    timeout_s: float = 600.0
    progress: Callable[[str], None] = lambda phase: None  # the controller's heartbeat: a repair is progress
    seen: int = 0  # repairs adopted so far
    adopted: list[Repair] = field(default_factory=list)

    def repair(self, view: WorkerGroup, rank: int, error: BaseException) -> None:
        """The replica at `rank` of `view` failed its call: replace every dead host it uses (or re-raise
        `error` when one of them holds a learner rank: that is a restart)."""
        dead = sorted(_dead([w.host for w in view.workers if w.dp_rank == rank]))
        if not dead:
            return  # already replaced (adopted since): the caller sends again
        if any(d in self.frozen for d in dead):
            raise error
        for d in dead:
            self._replace(d, self.version())

    def _replace(self, dead: str, version: int) -> None:
        """Repair `dead` (or wait for the controller repairing it, up to `timeout_s`) and adopt the result."""
        self.progress("replica repair")
        deadline = time.time() + self.timeout_s
        while True:
            status, value = ray.get(self.repairs.claim.remote(dead))
            if status == "done":
                return self.adopt()
            if status == "mine":
                break
            if time.time() > deadline:
                raise TimeoutError(f"replica repair of host {dead} did not finish in {self.timeout_s} s")
            time.sleep(0.1)
        try:
            repair = self._restart(dead, value, version)
        except BaseException:
            ray.get(self.repairs.abandon.remote(dead))
            raise
        ray.get(self.repairs.finish.remote(repair))
        self.adopt()

    def _restart(self, dead: str, made: list[HostRecord], version: int) -> Repair:
        """Start again, on their devices, the replicas that had a worker on `dead`; load current weights."""
        for record in made:  # hosts other controllers' repairs started: the same process for a device
            self.pool.hosts[record.device] = record
        for device, record in list(self.pool.hosts.items()):
            if host_id(record.handle) == dead:
                del self.pool.hosts[device]
        before = set(self.pool.hosts)
        workers: dict[str, list[Worker]] = {}
        created, count = [], 0
        for name, group in self.groups.items():
            ranks = _replicas_on(group, dead)
            if ranks and group.spawn is None:
                raise ValueError(f"replica repair: group {name!r} was not made by WorkerGroup.create")
            replicas = group.replicas()
            peers = [w for w in group.workers if w.group_dp_rank in ranks and host_id(w.host) != dead]
            gone = _dead([w.host for w in peers])  # surviving tp peers leave their broken group
            ray.get([w.host.destroy.remote(w.key) for w in peers if host_id(w.host) not in gone])
            for rank in ranks:
                made_w, refs = start_replica(
                    self.pool, group.spawn, group.role, group.name, replicas[rank], rank, group.dp_size
                )
                workers.setdefault(name, []).extend(made_w)
                created += refs
                count += 1
        ray.get(created)
        hosts = [self.pool.hosts[d] for d in sorted(set(self.pool.hosts) - before)]
        repair = Repair(dead, hosts, workers, count)
        self._load_weights(repair, version)
        return repair

    def _load_weights(self, repair: Repair, version: int) -> None:
        """Current weights, `version`, into the restarted replicas that the weight sync feeds."""
        sync = self.weight_sync
        if sync is None or self.learner is None:
            return
        fed = {(t.role, t.name) for t in sync.targets}
        targets = [
            WorkerGroup(g.role, g.name, repair.workers[name])
            for name, g in self.groups.items()
            if name in repair.workers and (g.role, g.name) in fed
        ]
        if not targets:
            return
        from yatt_controller.sync import WeightSync

        once = WeightSync(
            self.learner,
            targets,
            mode="broadcast",
            backend=sync.backend,
            bucket_bytes=sync.bucket_bytes,
            group=f"{sync.group}-repair-{uuid.uuid4().hex[:8]}",
        )
        once.setup()
        once.push(version)
        hosts = [self.learner.workers[0].host, *(host for host, _, _ in once.remote)]
        ray.get([host.sync_close.remote(once.group_name) for host in hosts])  # a group for this load only

    def adopt(self) -> list[Repair]:
        """Every repair not adopted yet: swapped into this controller's views and whole groups."""
        new = ray.get(self.repairs.log.remote(self.seen))
        for repair in new:
            for name, view in self.views.items():
                swap_workers(view, name, repair)
            for name, group in self.groups.items():
                swap_workers(group, name, repair)
            for record in repair.hosts:
                self.pool.hosts[record.device] = record
        self.seen += len(new)
        self.adopted += new
        return new

    def heal_sync(self) -> None:
        """Rank 0, before a push: replace dead remote targets (a replica that died idle) and re-form the
        broadcast group when any of its hosts was replaced."""
        sync = self.weight_sync
        if sync is None:
            return
        self.adopt()
        for dead in sorted(_dead([host for host, _, _ in sync.remote]) - self.frozen):
            self._replace(dead, self.version())
        dead = {r.dead for r in self.adopted}
        for target in sync.targets:
            for name, group in self.groups.items():
                if (group.role, group.name) == (target.role, target.name):
                    for repair in self.adopted:
                        swap_workers(target, name, repair)
        if any(host_id(host) in dead for host, _, _ in sync.remote):
            sync.retarget(sync.targets)

    def replaced(self) -> int:
        return ray.get(self.repairs.replaced.remote())


def _dead(handles: list[Any], timeout_s: float = 10.0) -> set[str]:
    """Ids of the hosts among `handles` whose process is dead (their ping fails); a slow answer is alive."""
    refs = [(handle.ping.remote(), host_id(handle)) for handle in handles]
    if refs:
        ray.wait([ref for ref, _ in refs], num_returns=len(refs), timeout=timeout_s)
    dead = set()
    for ref, hid in refs:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.add(hid)
        except ray.exceptions.GetTimeoutError:
            pass
    return dead
