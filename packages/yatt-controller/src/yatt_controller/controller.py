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

import msgspec
import ray

from yatt_controller import checkpoint
from yatt_controller.collective import Collective
from yatt_controller.dispatch import fetch
from yatt_controller.sync import WeightSync, check_versions
from yatt_controller.types import Heartbeat, StepReport
from yatt_controller.worker_group import WorkerGroup, routed_views

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
    collective_timeout_s: float = 600.0
    # other stateful services (a PPO critic): name -> this controller's view; checkpointed like the learner
    checkpointed: dict[str, WorkerGroup] = field(default_factory=dict)
    # live re-placement (Job.replan): the run's Directory actor, the driver's host pool, the unrouted groups
    # and how to route them again (replace.py)
    directory: Any = None
    pool: Any = None
    full_groups: dict[str, WorkerGroup] = field(default_factory=dict)
    learner_name: str | None = None
    max_inflight: int = 8
    single: bool = False
    repairs: Any = None  # the attempt's Repairs actor: dead service replicas replaced mid-step (faults.py)

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
        """Values of object refs (counted against the driver when this controller is the driver)."""
        values = fetch(refs)
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
        # finished and not yet logged by the driver (its heartbeat says how far it has logged): a checkpoint
        # carries them, so a run resumed after the driver died logs the steps it had not (saved_reports)
        self._unlogged: list[StepReport] = []
        self.moves = 0  # live re-placements applied (rank 0 counts them in its reports)
        services = [n for n in plan.services if n != plan.learner_name and n not in plan.checkpointed]
        # replicas that can be replaced exist: a learner-only job reports no fault count
        self.healer = self._healer() if plan.repairs is not None and services else None

    def _healer(self) -> Any:
        """Replacement of dead service replicas for this controller's service views (faults.py)."""
        from yatt_controller.faults import Healer, frozen_hosts

        plan = self.plan
        frozen = [*([plan.learner_name] if plan.learner_name else []), *plan.checkpointed]
        groups = plan.full_groups or dict(plan.services)
        healer = Healer(
            repairs=plan.repairs,
            pool=plan.pool,
            groups=groups,
            views=plan.services,
            frozen=frozen_hosts(groups, frozen),
            learner=plan.learner,
            weight_sync=plan.weight_sync,
            version=lambda: self.ctx.policy_version,
            timeout_s=plan.collective_timeout_s,
            progress=self._progress,
        )
        self._attach(healer)
        if plan.rank == 0:
            self.ctx.before_push = healer.heal_sync
        return healer

    def _attach(self, healer: Any) -> None:
        """The healer on every service view that is neither the learner nor checkpointed."""
        for name, view in self.plan.services.items():
            if name != self.plan.learner_name and name not in self.plan.checkpointed:
                view.healer = healer

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
            self._unlogged = [r for r in self._unlogged if r.step > logged_through]
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return Heartbeat(actor=self.label, node_id=node, step=step, phase=phase, time_unix=when), reports

    def run(self, start_step: int, end_step: int) -> int:
        for step in range(start_step, end_step):
            self.ctx.step, self.ctx.timings_s = step, {}
            self._progress("data")
            started = time.perf_counter()
            if self.plan.directory is not None:
                self._progress("placement")
                self._maybe_move(step)
            if self.healer is not None:  # replicas other controllers replaced: no call goes to a dead host
                self.healer.adopt()
            batch = self._next_rows()
            metrics = self.plan.step_fn(self.ctx, batch)
            self.ctx.timings_s["step"] = time.perf_counter() - started
            if not isinstance(metrics, dict):
                raise ValueError(
                    f"step_fn must return a dict of metrics, got {type(metrics).__name__} at step {step}"
                )
            if self.plan.directory is not None and self.plan.rank == 0:
                metrics = {**metrics, **self._placement_metrics()}
            if self.healer is not None and self.plan.rank == 0:
                metrics = {**metrics, "faults/replicas_replaced": float(self.healer.replaced())}
            report = StepReport(
                step=step,
                controller_rank=self.plan.rank,
                metrics={k: float(v) for k, v in metrics.items()},
                timings_s=dict(self.ctx.timings_s),
                num_samples=len(batch),
            )
            with self._lock:
                self._unlogged.append(report)
            every = self.plan.checkpoint_every
            # every k steps, and the last step of the run (what export and a finished run's resume read)
            if self.plan.checkpoint_dir and every and ((step + 1) % every == 0 or step == end_step - 1):
                self._progress("checkpoint")
                self.save(step)
            with self._lock:
                self._reports.append(report)
                self._beat = (step + 1, "step done", time.time())
        return end_step

    def _placement_metrics(self) -> dict[str, float]:
        """Live placement: moves so far and the devices each service group holds now
        (`placement/<group>_devices`, e.g. placement/rollout_devices)."""
        devices = {
            f"placement/{name}_devices": float(sum(len(r) for r in group.replicas()))
            for name, group in (self.plan.full_groups or {}).items()
        }
        return {"placement/moves": float(self.moves), **devices}

    def _maybe_move(self, step: int) -> None:
        """Apply a posted plan, all controllers at this same step (a weight-sync boundary)."""
        plan, col = self.plan, self.ctx.collective
        pending = ray.get(plan.directory.take.remote()) if plan.rank == 0 else None
        pending = col.all_gather(pending)[0]  # rank 0's decision, seen by every controller
        if pending is None:
            return
        if plan.rank == 0:
            from yatt_controller.replace import apply_move

            groups, hosts = apply_move(
                plan.pool, plan.full_groups, pending, plan.weight_sync, self.ctx.policy_version
            )
            ray.get(plan.directory.publish.remote(step, pending, groups, hosts))
        col.barrier()  # the moved groups are published and hold the current weights
        plan.full_groups = ray.get(plan.directory.groups.remote())
        views = routed_views(
            plan.full_groups,
            plan.learner_name,
            plan.rank,
            plan.world_size,
            plan.max_inflight,
            single=plan.single,
            uneven=True,
        )
        for name, view in views.items():
            if name != plan.learner_name and name not in plan.checkpointed:
                self.ctx.services[name] = view
        if self.healer is not None:  # the moved groups are what a dead host's replicas are looked up in
            self.healer.groups = plan.full_groups
            self._attach(self.healer)
        self.moves += 1

    def _state_bytes(self) -> bytes:
        version, internal, gauss = self.ctx.rng.getstate()
        state = {
            "policy_version": self.ctx.policy_version,
            "sampler": self.sampler.state(),
            "rng": [version, list(internal), gauss],
            "state": self.ctx.state,
        }
        with self._lock:  # this controller's reports the driver may not have logged, this step's included
            state["reports"] = list(self._unlogged)
        return msgspec.msgpack.encode(state)

    def save(self, step: int) -> None:
        """A collective checkpoint: rank 0 opens the staging directory, every controller writes its part
        (its own state and its learner ranks'), rank 0 writes the manifest and renames."""
        root, col = self.plan.checkpoint_dir, self.ctx.collective
        if self.plan.rank == 0:
            checkpoint.begin(root, step)
        col.barrier()
        staging = checkpoint.staging_dir(root, step)
        files = {
            f"controller-{self.plan.rank}.msgpack": checkpoint.write_file(
                staging, f"controller-{self.plan.rank}.msgpack", self._state_bytes()
            )
        }
        for prefix, group in self.plan.stateful():
            parts = fetch(group.broadcast("checkpoint_state"))
            for worker, data in zip(group.workers, parts, strict=True):
                if data:
                    name = f"{prefix}-{worker.group_dp_rank}.{worker.tp_rank}.bin"
                    files[name] = checkpoint.write_file(staging, name, data)
        everything = {k: v for part in col.all_gather(files) for k, v in part.items()}
        if self.plan.rank == 0:
            checkpoint.commit(
                root,
                step,
                everything,
                policy_version=self.ctx.policy_version,
                keep=self.plan.keep_checkpoints,
            )
        col.barrier()

    def prepare(self, path: Path | None) -> int:
        """Resume from a verified checkpoint (or start fresh); the engines then get the learner's weights.
        Returns the step to run next."""
        next_step = 0 if path is None else self._restore(path)
        self.ctx.collective.barrier()  # every learner rank holds its restored state
        if self.plan.rank == 0 and self.plan.weight_sync is not None:
            self.plan.weight_sync.push(self.ctx.policy_version)
        self.ctx.collective.barrier()
        return next_step

    def _restore(self, path: Path) -> int:
        manifest = checkpoint.verify(path)
        name = f"controller-{self.plan.rank}.msgpack"
        if name not in manifest.files:
            raise ValueError(f"{path} holds no {name}: it was written by a different number of controllers")
        state = msgspec.msgpack.decode((path / name).read_bytes())
        self.ctx.policy_version = state["policy_version"]
        self.sampler.load_state(state["sampler"])
        version, internal, gauss = state["rng"]
        self.ctx.rng.setstate((version, tuple(internal), gauss))
        self.ctx.state = state["state"]
        loads = []
        for prefix, group in self.plan.stateful():
            for worker in group.workers:
                part = f"{prefix}-{worker.group_dp_rank}.{worker.tp_rank}.bin"
                data = (path / part).read_bytes() if part in manifest.files else b""
                loads.append(worker.submit("load_checkpoint_state", (data,), {}))
        ray.get(loads)
        return manifest.step + 1


@ray.remote(concurrency_groups={"health": 1})
class ControllerActor:
    """A parallel controller: a `ControllerCore` in its own process; `heartbeat` has its own thread."""

    def __init__(self, plan: ControllerPlan, rendezvous: Any, label: str) -> None:
        self.core = ControllerCore(plan, rendezvous, label=label)

    def prepare(self, path: str | None) -> int:
        return self.core.prepare(None if path is None else Path(path))

    def run(self, start_step: int, end_step: int) -> int:
        return self.core.run(start_step, end_step)

    @ray.method(concurrency_group="health")
    def heartbeat(self, logged_through: int = -1) -> tuple[Heartbeat, list[StepReport]]:
        return self.core.heartbeat(logged_through)


def saved_reports(path: str | Path) -> list[StepReport]:
    """The step reports a verified checkpoint carries: each controller's reports that the driver had not
    logged (as far as its last heartbeat told) when the checkpoint was written, this checkpoint's step
    included. A run resumed from it logs the steps of these that its log lacks (checkpoints written before
    reports were saved carry none)."""
    path = Path(path)
    manifest = checkpoint.verify(path)
    out: list[StepReport] = []
    for name in sorted(manifest.files):
        if name.startswith("controller-") and name.endswith(".msgpack"):
            state = msgspec.msgpack.decode((path / name).read_bytes())
            out += [msgspec.convert(r, StepReport) for r in state.get("reports", [])]
    return out
