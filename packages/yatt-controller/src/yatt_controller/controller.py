"""A controller: runs the user's step function over its shard of the data, with handles to the services.

The same `ControllerCore` runs in both modes. Parallel: one Ray actor per data-parallel rank of the trainer,
each with its own shard, the service replicas routed to it, and its learner rank; calls go from it to the
services directly and no sample passes through the driver. Single (the baseline): one core in the driver,
holding every shard and every replica, so every sample is dispatched and collected by the driver.

The step function reads `step_fn(ctx: StepContext, batch: list) -> dict[str, float]` (its metrics) and is the
same in both modes: `ctx.services[name].scatter(...)` splits over whatever replicas this controller holds.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from yatt_controller import local_calls
from yatt_controller.collective import Collective
from yatt_controller.controller_checkpoint import ControllerCheckpoint
from yatt_controller.controller_checkpoint import saved_reports as saved_reports  # re-exported
from yatt_controller.dispatch import Dispatcher
from yatt_controller.roster import Roster
from yatt_controller.sync import WeightSync, check_versions
from yatt_controller.types import Heartbeat, StepReport
from yatt_controller.worker_group import WorkerGroup

StepFn = Callable[["StepContext", list], dict[str, float]]


@dataclass
class ControllerPlan:
    """Everything one controller needs, built by the driver (small: handles and functions, no data)."""

    rank: int
    world_size: int
    step_fn: StepFn
    dataset: Callable[[], Sequence[Any]]
    batch_size: int  # global, per step
    shards: list[int]
    num_shards: int
    seed: int
    services: dict[str, WorkerGroup]  # already routed: views of the replicas this controller calls
    learner: WorkerGroup | None = None
    weight_sync: WeightSync | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    checkpoint_async: bool = False  # sharded groups write in the background (ControllerSpec.checkpoint_async)
    collective_timeout_s: float = 600.0
    # other stateful services (a PPO critic): name -> this controller's view; checkpointed like the learner
    checkpointed: dict[str, WorkerGroup] = field(default_factory=dict)
    # the run's RosterBook actor and the roster it started from (roster.py): service replicas replaced by a
    # live move or a repair; `movable`: the job re-plans (rank 0 applies posted plans, reports placement/*)
    book: Any = None
    roster: Roster | None = None
    movable: bool = False
    pool: Any = None  # the driver's host pool (a copy here in parallel mode; its own in single mode)
    learner_name: str | None = None
    max_inflight: int = 8
    single: bool = False
    initial_push: Callable[[Any, int], None] | None = None  # Job.initial_push

    def stateful(self) -> list[tuple[str, WorkerGroup]]:
        """(file prefix, view) of every group whose workers' state goes into a checkpoint."""
        learner = [("learner", self.learner)] if self.learner is not None else []
        return learner + sorted(self.checkpointed.items())


@dataclass
class StepContext:
    """What a step function sees: its rank, the services, collectives, the RNG and checkpointed state."""

    rank: int
    world_size: int
    services: dict[str, WorkerGroup]
    learner: WorkerGroup | None
    collective: Collective
    rng: random.Random
    state: dict[str, Any]  # checkpointed with the controller: sampling buffers, EMAs, ...
    weight_sync: WeightSync | None = None
    step: int = 0
    policy_version: int = 0
    timings_s: dict[str, float] = field(default_factory=dict)
    on_progress: Callable[[str], None] = lambda phase: None
    next_rows: Callable[[], list] | None = None  # the controller's own sampler (set by ControllerCore)
    before_push: Callable[[], None] = lambda: None  # rank 0: re-form the sync around replaced replicas
    dispatcher: Dispatcher = field(default_factory=Dispatcher)  # this controller's fetches and resends

    @property
    def own_learner(self) -> WorkerGroup | None:
        """This controller's own learner ranks: its one data-parallel rank in parallel mode, every rank in
        single mode. Train with `own_learner.shard_rows(method, batch)`: each rank gets its contiguous rows
        and all of them join the SPMD call. `rank_zero` stays a dispatch mode for calls meant for one worker
        only; a training call sent that way in single mode leaves the other DDP ranks waiting forever."""
        return self.learner

    def next_batch(self) -> list:
        """This controller's part of the next global batch, drawn from its own shard: extra prompts for a
        refill (DAPO's dynamic sampling). The data cursor advances and is checkpointed, so a resumed run draws
        the same rows; the step loop's next batch comes after the drawn one."""
        if self.next_rows is None:
            raise ValueError("next_batch: this StepContext has no data sampler")
        return self.next_rows()

    def get(self, refs: Any) -> Any:
        """Values of object refs, fetched through this controller's dispatcher: a tracked call whose replica
        died is sent again to its replacement (counted against the driver when this controller is the
        driver). Streamed phases pass it on: `run_stream(..., fetch=ctx.get)`."""
        values = self.dispatcher.fetch(refs)
        self.on_progress("")
        return values

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (accumulated into the step report) and report it to the health monitor."""
        self.on_progress(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings_s[name] = self.timings_s.get(name, 0.0) + time.perf_counter() - start
            self.on_progress("")

    def all_reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        return self.collective.all_reduce(values, op)

    def all_gather(self, value: Any) -> list[Any]:
        return self.collective.all_gather(value)

    def barrier(self) -> None:
        self.collective.barrier()

    def check_versions(self, versions: Sequence[int], *, max_staleness: int = 0) -> None:
        """Refuse samples not made by the current policy version (raises `StaleSampleError`)."""
        check_versions(versions, self.policy_version, max_staleness=max_staleness)

    def sync_weights(self) -> int:
        """Push the learner's weights to the engines as the next version (rank 0 pushes; all wait)."""
        if self.weight_sync is None:
            raise ValueError("sync_weights: the job's services define no weight_sync")
        self.collective.barrier()  # every learner rank finished its update
        if self.rank == 0:
            self.before_push()
            self.weight_sync.push(self.policy_version + 1)
        self.collective.barrier()
        self.policy_version += 1
        return self.policy_version


class ControllerCore:
    """One controller's loop: sample, step, report, checkpoint. Thread-safe progress for the monitor."""

    def __init__(self, plan: ControllerPlan, rendezvous: Any = None, *, label: str = "controller-0") -> None:
        from yatt_controller.data import ShardSampler

        self.plan, self.label = plan, label
        self.rows = plan.dataset()
        self.sampler = ShardSampler(
            len(self.rows), plan.batch_size, seed=plan.seed, num_shards=plan.num_shards, shards=plan.shards
        )
        collective = Collective(rendezvous, plan.rank, plan.world_size, timeout_s=plan.collective_timeout_s)
        self.ctx = StepContext(
            rank=plan.rank,
            world_size=plan.world_size,
            services=plan.services,
            learner=plan.learner,
            collective=collective,
            rng=random.Random(plan.seed * 7919 + plan.rank),
            state={},
            weight_sync=plan.weight_sync,
            on_progress=self._progress,
            next_rows=self._next_rows,
        )
        self._lock = threading.Lock()
        self._beat = (0, "start", time.time())
        self._reports: list[StepReport] = []  # finished, not yet handed to a heartbeat
        self.checkpoint = ControllerCheckpoint(plan, self.ctx, self.sampler, self._lock)
        self.replacements = self._replacements()

    def _replacements(self) -> Any:
        """This controller's side of the roster (replicas.py), when the run has replaceable service groups
        (a learner-only job reports no fault count): its views track calls for resending."""
        from yatt_controller.replicas import Replacements, controller_routes

        plan, roster = self.plan, self.plan.roster
        if plan.book is None or roster is None:
            return None
        views = {name: view for name, view in plan.services.items() if roster.replaceable(name)}
        if not views:
            return None
        route = controller_routes(
            plan.learner_name, plan.rank, plan.world_size, plan.max_inflight, plan.single
        )
        keeper = Replacements(
            plan.book,
            roster,
            plan.pool,
            views,
            plan.learner,
            route,
            plan.weight_sync,
            plan.collective_timeout_s,
        )
        keeper.version, keeper.progress = (lambda: self.ctx.policy_version), self._progress
        self.ctx.dispatcher.repair = keeper.repair
        for view in views.values():
            view.traffic.dispatcher = self.ctx.dispatcher
        if plan.rank == 0:
            self.ctx.before_push = keeper.before_push
        return keeper

    def _next_rows(self) -> list:
        return [self.rows[i] for i in self.sampler.next()]

    def _progress(self, phase: str) -> None:
        with self._lock:
            self._beat = (self.ctx.step, phase or self._beat[1], time.time())

    def heartbeat(self, logged_through: int = -1) -> tuple[Heartbeat, list[StepReport]]:
        """The last progress and the reports finished since the previous heartbeat. `logged_through`: the
        driver has logged every step up to it, so later checkpoints need not carry those reports."""
        with self._lock:
            step, phase, when = self._beat
            reports, self._reports = self._reports, []
            self.checkpoint.logged(logged_through)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return Heartbeat(actor=self.label, node_id=node, step=step, phase=phase, time_unix=when), reports

    def run(self, start_step: int, end_step: int) -> int:
        for step in range(start_step, end_step):
            self.ctx.step, self.ctx.timings_s = step, {}
            self._progress("data")
            started = time.perf_counter()
            if self.replacements is not None:  # a posted move, and replicas others replaced: no call goes
                self._progress("placement")  # to a dead host
                self.replacements.start_step(step, self.ctx.collective, self.plan.rank, self.plan.movable)
            batch = self._next_rows()
            metrics = self.plan.step_fn(self.ctx, batch)
            self.checkpoint.settle()  # the previous step's background save, written while this step ran
            self.ctx.timings_s["step"] = time.perf_counter() - started
            if not isinstance(metrics, dict):
                raise ValueError(
                    f"step_fn must return a dict of metrics, got {type(metrics).__name__} at step {step}"
                )
            report = StepReport(
                step=step,
                controller_rank=self.plan.rank,
                metrics={k: float(v) for k, v in {**metrics, **self._roster_metrics()}.items()},
                timings_s=dict(self.ctx.timings_s),
                num_samples=len(batch),
            )
            self.checkpoint.unlogged(report)
            every = self.plan.checkpoint_every
            # every k steps, and the last step of the run (what export and a finished run's resume read)
            if self.plan.checkpoint_dir and every and ((step + 1) % every == 0 or step == end_step - 1):
                self._progress("checkpoint")
                self.save(step)
            with self._lock:
                self._reports.append(report)
                self._beat = (step + 1, "step done", time.time())
        if self.checkpoint.pending:  # the run waits for its last write before it ends
            self._progress("checkpoint")
            self.checkpoint.settle()
        if self.ctx.weight_sync is not None:  # and for a weight push its last step left under way
            self.ctx.weight_sync.settle()
        return end_step

    def _roster_metrics(self) -> dict[str, float]:
        """Rank 0: replicas replaced so far (`faults/replicas_replaced`) and, when the job re-plans, the moves
        so far and the devices each group holds now (`placement/<group>_devices`)."""
        if self.replacements is None or self.plan.rank != 0:
            return {}
        roster = self.replacements.adopt()
        out = {"faults/replicas_replaced": float(roster.replicas_replaced)}
        if self.plan.movable:
            out["placement/moves"] = float(len(roster.moves))
            for name, group in roster.groups.items():
                out[f"placement/{name}_devices"] = float(sum(len(r) for r in group.replicas()))
        return out

    def save(self, step: int) -> None:
        """A collective checkpoint of this controller and its learner ranks (controller_checkpoint.py)."""
        self.checkpoint.save(step)

    def prepare(self, path: Path | None) -> int:
        """Resume from a verified checkpoint (or start fresh); the engines then get the learner's weights.
        Returns the step to run next."""
        next_step = 0 if path is None else self.checkpoint.restore(path)
        self.ctx.collective.barrier()  # every learner rank holds its restored state
        if self.plan.weight_sync is not None and self.plan.initial_push is not None:
            self.plan.initial_push(self.ctx, self.ctx.policy_version)  # every controller takes part
        elif self.plan.rank == 0 and self.plan.weight_sync is not None:
            self.plan.weight_sync.push(self.ctx.policy_version)
        self.ctx.collective.barrier()
        return next_step


class Controller:
    """A parallel controller: a `ControllerCore` behind the three calls the driver makes. It lives in the
    host process of its learner rank's device (`_Host.create`; `startup.HostedController` is the driver's
    handle), or, for a job without a learner, in a process of its own (`ControllerActor`). `heartbeat` runs
    on a thread of its own while `run` is in progress."""

    def __init__(self, plan: ControllerPlan, rendezvous: Any, label: str) -> None:
        self.core = ControllerCore(plan, rendezvous, label=label)

    def hosted_by(self, here: local_calls.Here) -> None:
        """Its host process made it (`_Host.create`): the calls its views and weight sync make to the roles in
        that process run in process (`local_calls`)."""
        plan = self.core.plan
        for view in [*plan.services.values(), *([plan.learner] if plan.learner is not None else [])]:
            view.traffic.here = here
        if plan.weight_sync is not None:
            plan.weight_sync.here = here

    def prepare(self, path: str | None) -> int:
        return self.core.prepare(None if path is None else Path(path))

    def run(self, start_step: int, end_step: int) -> int:
        return self.core.run(start_step, end_step)

    @ray.method(concurrency_group="health")
    def heartbeat(self, logged_through: int = -1) -> tuple[Heartbeat, list[StepReport]]:
        return self.core.heartbeat(logged_through)


# the concurrency group gives `heartbeat` its own thread
ControllerActor = ray.remote(concurrency_groups={"health": 1})(Controller)
