"""Live re-placement: a new placement plan applied between two steps, without restarting the job.

Hosts count busy seconds per hosted role on every call (`Heartbeat.busy_s`). After every completed step the
driver pings them and hands the job's `replan(step, busy_s_since_last_call)` hook the per-role deltas; a plan
it returns (same roles, other replica lists) is validated and posted to the run's `Directory` actor. At the
start of every step the controllers agree on it (rank 0 takes it; the decision goes through the collective,
so all switch at the same step, which is a weight-sync boundary: the previous step's push is done). Rank 0
then, for every group whose replicas changed, destroys the replicas that leave, starts the new ones on their
devices (existing host processes, or new hosts on the devices' bundles) with the group's constructor
arguments, re-forms the weight sync for the new target set and pushes the CURRENT version, so no sample of a
stale version can be made; it publishes the new groups and every controller rebuilds its routed views.

Only groups that are neither the learner nor checkpointed may move. A restart after a move builds the job on
its original plan again and resumes from the checkpoint there (re-planned, not resumed into the moved
layout): the hook sees fresh busy times and may move again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import ray

from yatt_controller.worker_group import HostPool, HostRecord, Worker, WorkerGroup, start_replica


@ray.remote(num_cpus=0)
class Directory:
    """The run's mailbox for plans: the driver posts, rank 0 takes and publishes the moved groups."""

    def __init__(self) -> None:
        self._pending: Any = None
        self._groups: dict[str, WorkerGroup] | None = None
        self._hosts: list[HostRecord] = []
        self._moves: list[tuple[int, Any]] = []

    def post(self, plan: Any) -> None:
        self._pending = plan  # a later plan replaces one not taken yet

    def take(self) -> Any:
        plan, self._pending = self._pending, None
        return plan

    def publish(self, step: int, plan: Any, groups: dict[str, WorkerGroup], hosts: list[HostRecord]) -> None:
        self._groups = groups
        self._hosts += hosts
        self._moves.append((step, plan))

    def groups(self) -> dict[str, WorkerGroup] | None:
        return self._groups

    def state(self) -> tuple[list[HostRecord], list[tuple[int, Any]]]:
        """Hosts started by moves (the driver watches and tears them down) and the moves made (step, plan)."""
        return self._hosts, self._moves


def _placements(plan: Any) -> dict[tuple[str, str], list[list[int]]]:
    return {(p.role, p.name): [list(r) for r in p.replicas] for p in plan.roles}


def changed_roles(current: Any, new: Any, frozen: Mapping[tuple[str, str], str]) -> list[tuple[str, str]]:
    """The (role, name) whose replicas differ between two plans. ValueError if the new plan has other roles,
    devices outside the running plan, or moves a role of `frozen` ((role, name) -> why it cannot move)."""
    old, moved = _placements(current), _placements(new)
    if set(old) != set(moved):
        raise ValueError(f"replan: the new plan has roles {sorted(moved)}, the running plan {sorted(old)}")
    bad = sorted(
        {d for replicas in moved.values() for r in replicas for d in r} - set(range(current.num_devices))
    )
    if bad:
        raise ValueError(
            f"replan: devices {bad} are outside the running plan's {current.num_devices} devices"
        )
    changed = [key for key in old if old[key] != moved[key]]
    for key in changed:
        if key in frozen:
            role = f"{key[0]}:{key[1]}" if key[1] else key[0]
            raise ValueError(f"replan: role {role!r} cannot move: it is {frozen[key]}")
    return changed


def apply_move(
    pool: HostPool, groups: dict[str, WorkerGroup], plan: Any, weight_sync: Any, version: int
) -> tuple[dict[str, WorkerGroup], list[HostRecord]]:
    """Move every group whose replicas differ from `plan`: destroy the leaving replicas (all groups first, so
    devices are free), start the new ones, retarget the weight sync and push `version`. Returns the new groups
    (all of them) and the host records started on devices that had none."""
    wanted = _placements(plan)
    before = set(pool.hosts)
    moving = {n: g for n, g in groups.items() if wanted[(g.role, g.name)] != g.replicas()}
    for name, group in moving.items():
        if group.spawn is None:
            raise ValueError(f"replan: group {name!r} was not made by WorkerGroup.create; it cannot move")
        keep = wanted[(group.role, group.name)]
        ray.get([w.host.destroy.remote(w.key) for w in group.workers if _replica_of(group, w) not in keep])
    out, created = dict(groups), []
    for name, group in moving.items():
        old, new = group.replicas(), wanted[(group.role, group.name)]
        workers: list[Worker] = []
        for dp_rank, replica in enumerate(new):
            if replica in old:  # stays where it is, renumbered
                stay = [w for w in group.workers if w.dp_rank == old.index(replica)]
                workers += [
                    Worker(**{**w.__dict__, "dp_rank": dp_rank, "group_dp_rank": dp_rank}) for w in stay
                ]
            else:
                made, refs = start_replica(
                    pool, group.spawn, group.role, group.name, replica, dp_rank, len(new)
                )
                workers += made
                created += refs
        out[name] = WorkerGroup(group.role, group.name, workers, group.max_inflight, group.spawn)
    ray.get(created)
    if weight_sync is not None and moving:
        by_key = {(g.role, g.name): g for g in out.values()}
        weight_sync.retarget([by_key.get((t.role, t.name), t) for t in weight_sync.targets])
        weight_sync.push(version)
    return out, [pool.hosts[d] for d in sorted(set(pool.hosts) - before)]


def _replica_of(group: WorkerGroup, worker: Worker) -> list[int]:
    return group.replicas()[worker.dp_rank]


def busy_totals(beats: list[Any]) -> dict[str, float]:
    """Cumulative busy seconds per hosted key, summed over the hosts' heartbeats."""
    totals: dict[str, float] = {}
    for beat in beats:
        for key, seconds in beat.busy_s.items():
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


class Replacer:
    """The driver's side of live re-placement: busy-time deltas, the job's hook, validation, posting."""

    def __init__(self, hook: Any, plan: Any, services: Any, pool: HostPool) -> None:
        self.hook, self.current, self.pool = hook, plan, pool
        self.directory = Directory.remote()
        self.frozen: dict[tuple[str, str], str] = {}
        for name, group in services.groups.items():
            if name == services.learner:
                self.frozen[(group.role, group.name)] = "the learner"
            elif name in services.checkpointed:
                self.frozen[(group.role, group.name)] = "checkpointed"
        self.moves: list[tuple[int, Any]] = []
        self._last: dict[str, float] = {}  # busy totals at the previous call

    def _refresh(self) -> None:
        """Hosts started by moves join the driver's pool (pinged, counted, torn down); the moves so far."""
        hosts, moves = ray.get(self.directory.state.remote())
        for record in hosts:
            self.pool.hosts.setdefault(record.device, record)
        self.moves = list(moves)

    def after_step(self, step: int) -> None:
        """Fresh busy counters from every host, the hook, and a validated plan posted for the controllers."""
        self._refresh()
        try:
            beats = ray.get([r.handle.ping.remote() for r in list(self.pool.hosts.values())], timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return  # a dead or stuck host: the health monitor reports it; no re-plan on partial counters
        totals = busy_totals(beats)
        deltas = {key: totals[key] - self._last.get(key, 0.0) for key in sorted(totals)}
        self._last = totals
        plan = self.hook(step, deltas)
        if plan is not None and changed_roles(self.current, plan, self.frozen):
            ray.get(self.directory.post.remote(plan))
            self.current = plan

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort after a failure: the directory may be gone
            self._refresh()
        ray.kill(self.directory, no_restart=True)
