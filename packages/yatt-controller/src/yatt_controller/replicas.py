"""A controller's side of the roster: it adopts new versions, repairs a dead replica its call found, applies
a posted move, and re-forms the weight sync around replaced replicas.

Every controller holds one `Replacements`. A call made with `WorkerGroup.call_one` on a replaceable service
view is tracked by the controller's `Dispatcher`; when fetching it finds the replica's host dead, `repair`
asks the run's `RosterBook` for the right to replace that host (one replacement at a time, once per dead
host for the run: the others wait and adopt its result), calls `replace.replace_replicas`, and the call is
sent again, so the step goes on (seeded requests carry their seeds: the result equals an uninterrupted run's).
A move is the same operation, by rank 0 at the start of a step all controllers agreed on (a weight-sync
boundary). Adopting a version swaps the new workers into this controller's views in place, so a step that
holds a view sends its next call to the new replicas. Rank 0 re-forms the run's broadcast group before its
next push when a replacement changed its targets (and replaces targets that died idle).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from yatt_controller.replace import dead_among, dead_hosts, ping_hosts, replace_replicas, wanted_replicas
from yatt_controller.roster import Roster, host_id
from yatt_controller.worker_group import HostPool, WorkerGroup, routed_views


class Replacements:
    """One controller's replacements: `book` is the run's RosterBook actor, `views` this controller's routed
    service views (ctx.services; swapped in place), `learner` its own learner ranks (the weights' source)."""

    def __init__(
        self,
        book: Any,
        roster: Roster,
        pool: HostPool,
        views: dict[str, WorkerGroup],
        learner: WorkerGroup | None,
        route: Callable[[dict[str, WorkerGroup]], dict[str, WorkerGroup]],
        weight_sync: Any = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.book, self.roster, self.pool, self.views = book, roster, pool, views
        self.learner, self.route, self.weight_sync, self.timeout_s = learner, route, weight_sync, timeout_s
        self.synced = roster.version  # the roster version the weight sync's targets were formed from
        self.version: Callable[[], int] = lambda: 0  # the current policy version (what new replicas load)
        self.progress: Callable[[str], None] = lambda phase: None  # a replacement is progress (heartbeat)
        self.step = 0

    def adopt(self) -> Roster:
        """The newest roster version, its workers swapped into this controller's replaceable views."""
        newer = ray.get(self.book.newer.remote(self.roster.version))
        if newer is not None:
            self._use(newer)
        return self.roster

    def _use(self, roster: Roster) -> None:
        self.roster = roster
        for record in roster.hosts:  # hosts replacements started: one process per device
            self.pool.hosts[record.device] = record
        routed = self.route(roster.groups)
        for name, view in self.views.items():
            if roster.replaceable(name):
                view.rebind(routed[name].workers)

    def start_step(self, step: int, collective: Any, rank: int, movable: bool) -> None:
        """At every step start: a plan the re-planner posted is applied by rank 0, every controller at this
        same step (rank 0's decision goes through the collective); then every controller adopts the newest
        roster (replicas others replaced), so no call of this step goes to a dead host."""
        self.step = step
        if movable:
            pending = ray.get(self.book.take.remote()) if rank == 0 else None
            pending = collective.all_gather(pending)[0]
            if pending is not None:
                if rank == 0:
                    self.move(pending)
                collective.barrier()  # the moved groups are published and hold the current weights
        self.adopt()

    def repair(self, view: WorkerGroup, rank: int, error: BaseException) -> None:
        """The replica at `rank` of `view` failed its call: replace every dead host it uses, or re-raise
        `error` when one of them holds a group that may not be replaced (that is a restart)."""
        dead = sorted(dead_hosts([w.host for w in view.workers if w.dp_rank == rank]))
        if not dead:
            return  # replaced and adopted since: the caller sends again
        if set(dead) & self.roster.fixed_hosts():
            raise error
        for host in dead:
            self._replace(host, "repair")

    def move(self, plan: Any) -> None:
        """Rank 0, at a step start every controller agreed on: give the groups `plan` changes its replicas."""
        self._replace("move", "move", plan)

    def _replace(self, what: str, cause: str, plan: Any = None) -> None:
        """Claim the replacement of `what` (a dead host's id, or "move"), run it, publish the new version; or
        wait for the controller replacing it (up to `timeout_s`) and adopt its result."""
        self.progress(f"replica {cause}")
        deadline = time.time() + self.timeout_s
        while True:
            status, roster = ray.get(self.book.claim.remote(what))
            if status == "done":
                self.adopt()
                return
            if status == "mine":
                break
            if time.time() > deadline:
                raise TimeoutError(f"replica {cause} of {what} did not finish in {self.timeout_s} s")
            time.sleep(0.1)
        try:
            wanted = (
                wanted_replicas(roster, plan)
                if cause == "move"
                else {name: roster.groups[name].replicas() for name in roster.on_host(what)}
            )
            new = replace_replicas(
                self.pool,
                roster,
                wanted,
                cause=cause,
                step=self.step,
                plan=plan,
                dead="" if cause == "move" else what,
                learner=self.learner,
                weight_sync=self.weight_sync,
                version=self.version(),
            )
        except BaseException:
            ray.get(self.book.abandon.remote(what))
            raise
        ray.get(self.book.finish.remote(new))
        self._use(new)

    def before_push(self) -> None:
        """Rank 0, before a push: replace dead remote targets (a replica that died idle) and re-form the
        broadcast group when a replacement changed the targets."""
        sync = self.weight_sync
        if sync is None:
            return
        pings = ping_hosts([host for host, _, _ in sync.remote])  # they travel while the book answers
        self.adopt()
        for dead in sorted(dead_among(pings) - self.roster.fixed_hosts()):
            self._replace(dead, "repair")
        if self.roster.version == self.synced:
            return
        by_key = {(g.role, g.name): g for g in self.roster.groups.values()}
        targets = [by_key.get((t.role, t.name), t) for t in sync.targets]
        if _hosted(targets) != _hosted(sync.targets):
            sync.retarget(targets)
        self.synced = self.roster.version


def _hosted(groups: list[WorkerGroup]) -> list[tuple[str, str]]:
    return [(host_id(w.host), w.key) for g in groups for w in g.workers]


def controller_routes(
    learner: str | None, rank: int, world: int, max_inflight: int, single: bool
) -> Callable[[dict[str, WorkerGroup]], dict[str, WorkerGroup]]:
    """How one controller routes whole groups to its views (uneven service blocks allowed after a move)."""

    def route(groups: dict[str, WorkerGroup]) -> dict[str, WorkerGroup]:
        return routed_views(groups, learner, rank, world, max_inflight, single=single, uneven=True)

    return route
