"""Live re-placement, the driver's side: after every completed step, each role's busy seconds since the
previous call go to the job's `replan(step, busy_s)` hook; a plan it returns (same roles, other replica
lists) is checked against the running plan and the roster (only replaceable groups may move) and posted to
the run's `RosterBook`. Rank 0 applies it at the start of a later step (`replicas.Replacements.start_step`),
through the same `replace_replicas` that repairs dead replicas.

Hosts count busy seconds per hosted role on every call (`Heartbeat.busy_s`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from yatt_controller.replace import changed_roles
from yatt_controller.roster import Roster
from yatt_controller.worker_group import HostPool


def busy_totals(beats: list[Any]) -> dict[str, float]:
    """Cumulative busy seconds per hosted key, summed over the hosts' heartbeats."""
    totals: dict[str, float] = {}
    for beat in beats:
        for key, seconds in beat.busy_s.items():
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


class Replanner:
    """Busy-time deltas, the job's hook, validation, posting."""

    def __init__(self, hook: Callable[[int, dict[str, float]], Any], plan: Any, book: Any, pool: HostPool):
        self.hook, self.current, self.book, self.pool = hook, plan, book, pool
        self._last: dict[str, float] = {}  # busy totals at the previous call

    def after_step(self, step: int, roster: Roster) -> None:
        """Fresh busy counters from every host, the hook, and a validated plan posted for the controllers."""
        try:
            beats = ray.get([r.handle.ping.remote() for r in list(self.pool.hosts.values())], timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return  # a dead or stuck host: the health monitor reports it; no re-plan on partial counters
        totals = busy_totals(beats)
        deltas = {key: totals[key] - self._last.get(key, 0.0) for key in sorted(totals)}
        self._last = totals
        plan = self.hook(step, deltas)
        if plan is not None and changed_roles(self.current, plan, roster):
            ray.get(self.book.post.remote(plan))
            self.current = plan
