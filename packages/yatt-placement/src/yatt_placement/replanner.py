"""The dynamic re-planner: moves devices from the idlest to the busiest role, from measured `PhaseStats`.

WeChat-YATT lists dynamic placement as "in development" and publishes no algorithm; this one is ours.

Movable roles are those that do not span every device (in partial mode rollout and the GenRMs; in
disaggregated mode every role). Each step, per movable role, `busy_s` is smoothed by an EMA. A move happens
when all of these hold:
1. imbalance: gap = 1 - busy_lo / busy_hi > `gap_threshold`, hi the busiest and lo the idlest role (relative
   to the busiest role rather than the step, so a long training phase does not hide the imbalance);
2. persistence: rules 1, 3 and 4 hold for the same (lo, hi) pair on `patience` consecutive steps (a streak
   breaks on any other step);
3. payoff: moving one chunk c = lcm(mp_lo, mp_hi) devices is predicted, with time = busy x devices / devices'
   (work conserved, linear scaling), to cut the slowest role's time by at least `min_gain`;
4. feasibility: lo keeps at least one model-parallel group and the new layout keeps groups inside nodes;
5. hysteresis: a move that undoes the latest one (hi -> lo after lo -> hi) needs a gap larger than the gap
   that triggered the latest one (a strictly rising bar for flip-flops).
Then the plan is re-laid out (`version` + 1, `reason` set), the EMAs are rescaled to the prediction, and the
next `cooldown` steps are ignored (they may still run under the old plan until the weight-sync boundary).

6. verification: busy time predicts a move's payoff, the step time checks it. Busy seconds can mislead:
   where logical devices share physical units (4 on 2 CPU cores), a role's calls look long because they wait
   for a core, and giving it more devices may buy it none. So the `verify_steps` steps after a move's cooldown
   are its trial: when their median step time (`PhaseStats.step_time_s`) is more than `verify_tolerance`
   above the median of the last `verify_steps` steps before the move (in the layout it left, cooldown
   excluded; the smoothed step time when there were none), the move is undone (the previous plan again,
   `reason` saying why) and never proposed from that layout again. A move that leaves the step time within
   the tolerance stands (busy time decides; the step time vetoes what hurt: on a machine this noisy a test
   that asks for a faster step would also stop moves on the way to the best split). Meanwhile rules 1-3
   accumulate as usual, so the next move comes at once when it is due.

Why it does not oscillate: with exact stats, rule 3 alone forbids an immediate reversal (after lo -> hi
passed it, both roles' predicted times are below (1 - min_gain) x busy_hi, and the reverse move predicts
busy_hi again). Noisy stats can fake a payoff, so rule 5 makes every reversal need a strictly larger gap than
the move it undoes; the gap is at most 1, so flip-flopping dies out, while a real drift, whose imbalance keeps
growing, still gets its reversal.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from yatt_placement.memory import check_memory
from yatt_placement.planner import lay_out, role_key
from yatt_placement.types import ClusterSpec, PhaseStats, PlacementPlan, ReplanConfig, RoleSpec


class DynamicReplanner:
    """Stateful: feed it one `PhaseStats` per step with `observe`; it returns a new plan or None."""

    def __init__(
        self,
        cluster: ClusterSpec,
        roles: list[RoleSpec],
        plan: PlacementPlan,
        config: ReplanConfig | None = None,
    ) -> None:
        self.cluster, self.roles, self.plan = cluster, list(roles), plan
        self.config = config or ReplanConfig()
        self.specs = {role_key(spec): spec for spec in roles}
        self.last_reason = "no step observed yet"
        self._busy: dict[str, float] = {}
        self._step_time = 0.0
        self._pair: tuple[str, str] | None = None
        self._streak = 0
        self._cooldown = 0
        self._warmup = self.config.warmup_steps
        self._last_move: tuple[str, str] | None = None  # (donor, receiver) of the latest move
        self._last_gap = 0.0  # the gap that triggered it
        self._trial: _Trial | None = None  # the latest move while its payoff is measured
        # the latest steps of the current layout (after its cooldown): a trial's "before"
        self._recent: deque[float] = deque(maxlen=max(self.config.verify_steps, 1))
        self._refuted: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # (devices before, after) moves

    def movable(self) -> list[str]:
        """Role keys that hold part of the cluster (and so can give or take devices)."""
        return [
            role_key(p)
            for p in self.plan.roles
            if sum(len(r) for r in p.replicas) < self.plan.num_devices or self.plan.mode == "disaggregated"
        ]

    def devices(self, key: str) -> int:
        return self.counts()[key]

    def observe(self, stats: PhaseStats) -> PlacementPlan | None:
        """Record one step; return the new plan (with its `reason`) when a move is due, else None (and
        `last_reason` says why not)."""
        keys = self.movable()
        if len(keys) < 2:
            self.last_reason = f"nothing to move: {self.plan.mode} plan has {len(keys)} movable roles"
            return None
        self._check(stats, keys)
        if self._warmup:  # not smoothed either: one warm-up step would dominate the averages for long
            self._warmup -= 1
            self.last_reason = "warm-up step: its calls pay one-time costs (compile, allocation)"
            return None
        self._smooth(stats, keys)
        if self._cooldown:
            self._cooldown -= 1
            self.last_reason = "cooling down after a move"
            return None
        self._recent.append(stats.step_time_s)
        if self._trial is not None:
            self._trial.after.append(stats.step_time_s)
            if len(self._trial.after) >= self.config.verify_steps:
                trial, self._trial = self._trial, None
                if trial.hurt(self.config.verify_tolerance):
                    return self._undo(trial)
        lo = min(keys, key=lambda k: self._busy[k])
        hi = max(keys, key=lambda k: self._busy[k])
        gap = 1.0 - self._busy[lo] / self._busy[hi] if self._busy[hi] > 0 else 0.0
        threshold = self.config.gap_threshold
        if self._last_move == (hi, lo):  # undoing the latest move must beat the gap that caused it
            threshold = max(threshold, self._last_gap)
        if gap <= threshold:
            self._pair, self._streak = None, 0
            self.last_reason = f"gap {gap:.3f} <= threshold {threshold:.3g}"
            return None
        proposal = self._propose(lo, hi)
        if isinstance(proposal, str):  # infeasible or not worth it: the streak starts over
            self._pair, self._streak, self.last_reason = None, 0, proposal
            return None
        self._streak = self._streak + 1 if self._pair == (lo, hi) else 1
        self._pair = (lo, hi)
        if self._trial is not None:  # the latest move's trial runs: no other move before its verdict
            done, total = len(self._trial.after), self.config.verify_steps
            self.last_reason = f"measuring the latest move's payoff: {done}/{total} steps"
            return None
        if self._streak < self.config.patience:
            self.last_reason = f"{hi} over {lo} by {gap:.3f} for {self._streak}/{self.config.patience} steps"
            return None
        return self._apply(lo, hi, gap, *proposal)

    def _check(self, stats: PhaseStats, keys: list[str]) -> None:
        if stats.step_time_s <= 0:
            raise ValueError(
                f"PhaseStats.step_time_s must be > 0, got {stats.step_time_s} (step {stats.step})"
            )
        missing = [key for key in keys if key not in stats.busy_s]
        if missing:
            raise ValueError(f"PhaseStats.busy_s has no entry for {missing} (step {stats.step})")

    def _smooth(self, stats: PhaseStats, keys: list[str]) -> None:
        d = self.config.ema_decay
        for key in keys:
            old = self._busy.get(key, stats.busy_s[key])
            self._busy[key] = d * old + (1 - d) * stats.busy_s[key]
        self._step_time = d * (self._step_time or stats.step_time_s) + (1 - d) * stats.step_time_s

    def _propose(self, lo: str, hi: str) -> tuple[PlacementPlan, dict[str, float]] | str:
        """The plan after moving one chunk lo -> hi and the predicted busy times, or why not."""
        mp_lo, mp_hi = self.specs[lo].model_parallel_size, self.specs[hi].model_parallel_size
        chunk = math.lcm(mp_lo, mp_hi)
        d_lo, d_hi = self.devices(lo), self.devices(hi)
        if d_lo - chunk < mp_lo:
            return f"{lo} has {d_lo} devices: cannot give {chunk} and keep a replica"
        predicted = dict(self._busy)
        predicted[lo] = self._busy[lo] * d_lo / (d_lo - chunk)
        predicted[hi] = self._busy[hi] * d_hi / (d_hi + chunk)
        before, after = max(self._busy.values()), max(predicted.values())
        if after > before * (1 - self.config.min_gain):
            return f"moving {chunk} devices {lo} -> {hi} predicts {after:.4g} s vs {before:.4g} s"
        counts = self.counts()
        layout = tuple(counts.values())
        counts[lo], counts[hi] = d_lo - chunk, d_hi + chunk
        if (layout, tuple(counts.values())) in self._refuted:
            return f"moving {chunk} devices {lo} -> {hi} was tried from this layout and made the step slower"
        try:
            new = lay_out(self.cluster, self.roles, self.plan.mode, counts)
            check_memory(new, self.cluster, self.roles)
        except ValueError as error:
            return f"moving {chunk} devices {lo} -> {hi} is infeasible: {error}"
        return new, predicted

    def counts(self) -> dict[str, int]:
        """Devices of every role of the current plan, in plan order."""
        return {role_key(p): sum(len(r) for r in p.replicas) for p in self.plan.roles}

    def _undo(self, trial: _Trial) -> PlacementPlan:
        """The plan before `trial`'s move again (version + 1), its busy EMAs restored; that move refuted."""
        after = self.counts()
        self._refuted.add((tuple(trial.counts.values()), tuple(after.values())))
        new = lay_out(self.cluster, self.roles, self.plan.mode, trial.counts)
        new.version = self.plan.version + 1
        measured = statistics.median(trial.after)
        limit = (1 + self.config.verify_tolerance) * trial.before_s
        new.reason = (
            f"the move to {_layout(after)} made the step slower: {measured:.4g} s over {len(trial.after)} steps "
            f"vs {trial.before_s:.4g} s before it (more than {limit:.4g} s): back to {_layout(trial.counts)}, "
            "and that move is not tried again from there"
        )
        self.plan, self._busy = new, dict(trial.busy)
        self._recent.clear()
        self._step_time = trial.before_s
        self._pair, self._streak, self._cooldown = None, 0, self.config.cooldown
        self._last_move, self._last_gap = None, 0.0
        self.last_reason = new.reason
        return new

    def _apply(
        self, lo: str, hi: str, gap: float, new: PlacementPlan, predicted: dict[str, float]
    ) -> PlacementPlan:
        if self.config.verify_steps:
            before = statistics.median(self._recent) if self._recent else self._step_time
            self._trial = _Trial(self.counts(), dict(self._busy), before)
        new.version = self.plan.version + 1
        moved = self.devices(lo) - sum(len(r) for p in new.roles if role_key(p) == lo for r in p.replicas)
        new.reason = (
            f"{hi} busy {self._busy[hi] / self._step_time:.2f} vs {lo} {self._busy[lo] / self._step_time:.2f} "
            f"of step time (gap {gap:.2f}) for {self._streak} steps: moved {moved} devices {lo} -> {hi} "
            f"({self.devices(lo) - moved} / {self.devices(hi) + moved}), predicted slowest "
            f"{max(self._busy.values()):.4g} s -> {max(predicted.values()):.4g} s"
        )
        self.plan, self._busy = new, predicted
        self._recent.clear()
        self._pair, self._streak, self._cooldown = None, 0, self.config.cooldown
        self._last_move, self._last_gap = (lo, hi), gap
        self.last_reason = new.reason
        return new


class _Trial:
    """A move under trial: the layout and busy EMAs before it, the step time before it and the steps after."""

    def __init__(self, counts: dict[str, int], busy: dict[str, float], before_s: float) -> None:
        self.counts, self.busy, self.before_s = counts, busy, before_s
        self.after: list[float] = []

    def hurt(self, tolerance: float) -> bool:
        """Whether the median step after the move is more than `tolerance` above the step before it."""
        return statistics.median(self.after) > (1 + tolerance) * self.before_s


def _layout(counts: dict[str, int]) -> str:
    return " / ".join(f"{key} {n}" for key, n in counts.items())
