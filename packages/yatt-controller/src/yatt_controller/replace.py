"""Replacing replicas: the one operation behind a live move and the repair of a dead replica.

`replace_replicas(pool, roster, wanted, ...)` gives the groups in `wanted` the replicas it lists: replicas
that stay (same devices, living host) keep their workers; the others are destroyed (all groups first, so
their devices are free), started on their devices (existing host processes, or new ones on the devices'
bundles) with the group's constructor arguments, and loaded with the CURRENT weights from the caller's own
learner ranks when the weight sync feeds them; it returns the next roster version. A move passes the plan's
replicas; a repair passes the replicas as they are and the dead host, whose replicas are started again
(surviving tensor-parallel peers leave their broken group). Only groups the roster calls replaceable are
accepted. The controllers' side (who calls it when, how calls in flight are sent again, how every controller
adopts a new version) is `Replacements` in `replicas.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import ray

from yatt_controller.roster import Change, Roster, host_id
from yatt_controller.worker_group import HostPool, Worker, WorkerGroup, start_replica


def replace_replicas(
    pool: HostPool,
    roster: Roster,
    wanted: Mapping[str, list[list[int]]],
    *,
    cause: str,
    step: int,
    learner: WorkerGroup | None,
    weight_sync: Any,
    version: int,
    plan: Any = None,
    dead: str = "",
) -> Roster:
    """Give every group in `wanted` (name -> device lists, one per replica) those replicas, replacing what
    must change (and every replica with a worker on host `dead`); load policy `version` into the new ones
    from `learner`. Returns `roster`'s next version, whose history records the change."""
    for name in wanted:
        if not roster.replaceable(name):
            raise ValueError(
                f"replace_replicas: group {name!r} is {roster.fixed_because(name)}; never replaced"
            )
        if roster.groups[name].spawn is None:
            raise ValueError(f"replace_replicas: group {name!r} was not made by WorkerGroup.create")
    _adopt_hosts(pool, roster, dead)
    before = set(pool.hosts)
    kept = {name: _kept(roster.groups[name], wanted[name], dead) for name in wanted}
    for name, keep in kept.items():  # every leaving worker first: the devices are free for the new ones
        group = roster.groups[name]
        leaving = [w for w in group.workers if w.dp_rank not in keep.values() and host_id(w.host) != dead]
        gone = dead_hosts([w.host for w in leaving])  # surviving tp peers of a dead replica leave its group
        ray.get([w.host.destroy.remote(w.key) for w in leaving if host_id(w.host) not in gone])
    groups: dict[str, WorkerGroup] = {}
    fresh: dict[str, list[Worker]] = {}
    created: list[ray.ObjectRef] = []
    count = 0
    for name, keep in kept.items():
        group = roster.groups[name]
        workers: list[Worker] = []
        new: list[Worker] = []
        for dp_rank, replica in enumerate(wanted[name]):
            if dp_rank in keep:  # stays where it is, renumbered
                stay = [w for w in group.workers if w.dp_rank == keep[dp_rank]]
                workers += [_renumbered(w, dp_rank) for w in stay]
                continue
            assert group.spawn is not None
            made, refs = start_replica(
                pool, group.spawn, group.role, group.name, replica, dp_rank, len(wanted[name])
            )
            workers, new, created, count = workers + made, new + made, created + refs, count + 1
        groups[name] = WorkerGroup(group.role, group.name, workers, group.max_inflight, group.spawn)
        if new:
            fresh[name] = new
    ray.get(created)  # all at once: hosted classes may rendezvous with each other in __init__
    _load_weights(roster, fresh, learner, weight_sync, version)
    change = Change(roster.version + 1, step, cause, tuple(sorted(fresh)), count, plan, dead)
    return roster.after(change, groups, [pool.hosts[d] for d in sorted(set(pool.hosts) - before)])


def _adopt_hosts(pool: HostPool, roster: Roster, dead: str) -> None:
    """The caller's pool learns the hosts other replacements started (one process per device) and forgets
    the dead one, so its device gets a fresh process."""
    for record in roster.hosts:
        pool.hosts[record.device] = record
    for device, record in list(pool.hosts.items()):
        if dead and host_id(record.handle) == dead:
            del pool.hosts[device]


def _kept(group: WorkerGroup, replicas: list[list[int]], dead: str) -> dict[int, int]:
    """New dp rank -> old dp rank of the replicas that stay: same devices, no worker on the dead host."""
    old = group.replicas()
    alive = {w.dp_rank for w in group.workers} - {w.dp_rank for w in group.workers if host_id(w.host) == dead}
    return {new: old.index(r) for new, r in enumerate(replicas) if r in old and old.index(r) in alive}


def _renumbered(worker: Worker, dp_rank: int) -> Worker:
    return Worker(**{**worker.__dict__, "dp_rank": dp_rank, "group_dp_rank": dp_rank, "traffic": None})


def _load_weights(
    roster: Roster, fresh: dict[str, list[Worker]], learner: WorkerGroup | None, sync: Any, version: int
) -> None:
    """Policy `version` into the new replicas that the weight sync feeds, from the caller's own learner
    ranks, over a group formed for this load only (the run's broadcast group is re-formed by rank 0 before
    its next push: `Replacements.before_push`)."""
    if sync is None or learner is None:
        return
    fed = {(t.role, t.name) for t in sync.targets}
    targets = [
        WorkerGroup(g.role, g.name, fresh[name])
        for name, g in roster.groups.items()
        if name in fresh and (g.role, g.name) in fed
    ]
    if not targets:
        return
    from yatt_controller.sync import WeightSync

    once = WeightSync(
        learner,
        targets,
        backend=sync.backend,
        bucket_bytes=sync.bucket_bytes,
        group=f"{sync.group}-load-{uuid.uuid4().hex[:8]}",
    )
    once.setup()
    once.push(version)
    if once.group_name:  # a group for this load only
        hosts = [learner.workers[0].host, *(host for host, _, _ in once.remote)]
        ray.get([host.sync_close.remote(once.group_name) for host in hosts])


def dead_hosts(handles: list[Any], timeout_s: float = 10.0) -> set[str]:
    """Ids of the hosts among `handles` whose process is dead (their ping fails); a slow answer is alive."""
    return dead_among(ping_hosts(handles), timeout_s)


def ping_hosts(handles: list[Any]) -> list[tuple[Any, str]]:
    """A ping sent to each of `handles`: (its ref, the host's id), for `dead_among` (the caller may do other
    work while they travel)."""
    return [(handle.ping.remote(), host_id(handle)) for handle in handles]


def dead_among(refs: list[tuple[Any, str]], timeout_s: float = 10.0) -> set[str]:
    """Ids of the hosts whose ping (`ping_hosts`) fails within `timeout_s`; a slow answer is alive."""
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


def changed_roles(current: Any, new: Any, roster: Roster) -> list[tuple[str, str]]:
    """The (role, name) whose replicas differ between two plans. ValueError if the new plan has other roles,
    devices outside the running plan, or moves a group the roster may not replace."""
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
    names = {(g.role, g.name): name for name, g in roster.groups.items()}
    changed = [key for key in old if old[key] != moved[key]]
    for key in changed:
        why = roster.fixed_because(names[key]) if key in names else None
        if why is not None:
            role = f"{key[0]}:{key[1]}" if key[1] else key[0]
            raise ValueError(f"replan: role {role!r} cannot move: it is {why}")
    return changed


def wanted_replicas(roster: Roster, plan: Any) -> dict[str, list[list[int]]]:
    """Group name -> the plan's replicas, for the groups whose replicas the plan changes."""
    placed = _placements(plan)
    return {
        name: placed[(g.role, g.name)]
        for name, g in roster.groups.items()
        if (g.role, g.name) in placed and placed[(g.role, g.name)] != g.replicas()
    }


def _placements(plan: Any) -> dict[tuple[str, str], list[list[int]]]:
    return {(p.role, p.name): [list(r) for r in p.replicas] for p in plan.roles}
