"""Live re-placement, the driver's side: after every completed step, each role's busy seconds since the
previous usable reading and the step's wall seconds go to the job's `replan(step, busy_s, step_s)` hook; a
plan it returns (same roles, other replica lists) is checked against the running plan and the roster (only
replaceable groups may move) and posted to the run's `RosterBook`. Rank 0 applies it at the start of a later step (`replicas.Replacements
.start_step`), through the same `replace_replicas` that repairs dead replicas.

Hosts count busy seconds per hosted role on every call (`Heartbeat.busy_s`); `BusyReadings` turns those
cumulative counters into readings a re-planner can trust. Why it is not a plain difference per step:
- step reports reach the driver with its heartbeat poll, often several at once (steps shorter than the poll
  interval): the first report's difference holds all their work and the next ones' nearly none. A reading
  whose window is under a quarter of the last used one is carried into the next (the hook gets `{}`), so each
  reading spans at least about one poll and the busy ratio between roles is meaningful;
- a posted plan is applied a step or two later, by rank 0 at a step start: until then readings measure the
  old layout, and the step that applied it paid for building the new replicas (their first calls included).
  Readings through that step are dropped (`{}`), so the hook never judges a layout by a mixture.
The hook is called once per reported step, with `{}` where the step has no usable reading of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from yatt_controller.replace import changed_roles
from yatt_controller.roster import Roster
from yatt_controller.worker_group import HostPool

CARRY_FRACTION = 0.25  # a reading whose window is under this share of the last used window is carried


def busy_totals(beats: list[Any]) -> dict[str, float]:
    """Cumulative busy seconds per hosted key, summed over the hosts' heartbeats."""
    totals: dict[str, float] = {}
    for beat in beats:
        for key, seconds in beat.busy_s.items():
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


class BusyReadings:
    """Cumulative busy totals in, per-role busy seconds of a usable window out (pure: no Ray).

    `read(totals, now, usable)`: `usable` False drops the window (the baseline moves on, `{}` out); a window
    shorter than `CARRY_FRACTION` of the last used one is carried (`{}` out, the baseline stays)."""

    def __init__(self, started: float) -> None:
        self._last: dict[str, float] = {}  # totals at the end of the last used (or dropped) window
        self._since = started  # when that window ended
        self._window = 0.0  # length of the last used window (0: none yet)
        self._read = False  # whether a window was used yet

    def read(self, totals: dict[str, float], now: float, *, usable: bool = True) -> dict[str, float]:
        if not usable:
            self._last, self._since = dict(totals), now
            return {}
        window = now - self._since
        if window < CARRY_FRACTION * self._window:
            return {}
        deltas = {key: totals[key] - self._last.get(key, 0.0) for key in sorted(totals)}
        # the first window also spans the start-up (building the services): no measure of a step's length
        self._window = window if self._read else 0.0
        self._last, self._since, self._read = dict(totals), now, True
        return deltas


class Replanner:
    """Busy-time readings, the job's hook, validation, posting; holds readings while a posted plan lands."""

    def __init__(
        self,
        hook: Callable[[int, dict[str, float], float], Any],
        plan: Any,
        book: Any,
        pool: HostPool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.hook, self.current, self.book, self.pool, self.clock = hook, plan, book, pool, clock
        self.readings = BusyReadings(clock())
        self._moves_seen = 0  # live moves the roster held at the last call
        self._hold_through: float | None = None  # readings through this step are dropped (inf: not landed)

    def after_step(self, step: int, roster: Roster, step_s: float) -> None:
        """Fresh busy counters from every host, the hook (with `step_s`, the step's wall seconds as its
        report gives them), and a validated plan posted for the controllers."""
        try:
            beats = ray.get([r.handle.ping.remote() for r in list(self.pool.hosts.values())], timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return  # a dead or stuck host: the health monitor reports it; no re-plan on partial counters
        busy = self.readings.read(busy_totals(beats), self.clock(), usable=self._usable(step, roster))
        plan = self.hook(step, busy, step_s)
        if plan is not None and changed_roles(self.current, plan, roster):
            ray.get(self.book.post.remote(plan))
            self.current = plan
            self._hold_through = float("inf")  # until the roster shows it applied

    def _usable(self, step: int, roster: Roster) -> bool:
        """False while a posted plan is pending, and through the step that applied it."""
        moves = roster.moves
        if len(moves) > self._moves_seen:
            self._moves_seen = len(moves)
            self._hold_through = moves[-1][0]  # the step it was applied at
        if self._hold_through is None:
            return True
        if step <= self._hold_through:
            return False
        self._hold_through = None
        return True
