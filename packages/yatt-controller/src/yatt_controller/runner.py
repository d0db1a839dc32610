"""The driver: launch the controllers, watch their health, restart from the last checkpoint or fail fast.

`run(spec, job, realized)` builds the job's services on the realized plan, starts the controllers (one actor
per data-parallel rank of the trainer in parallel mode; one core in a driver thread in single mode), and then
only watches: every `heartbeat_interval_s` it collects heartbeats and step reports and pings every host. A
dead actor, a failed controller, or no progress for `hang_timeout_s` tears the attempt down; with
`on_failure="restart"` the run is rebuilt and resumed from the newest complete checkpoint, up to
`max_restarts` times; otherwise `ControllerFailure` names the actor and its node. Never a silent hang.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import ray

from yatt_controller import checkpoint
from yatt_controller.collective import Rendezvous
from yatt_controller.controller import ControllerActor, ControllerCore, ControllerPlan, StepFn, saved_reports
from yatt_controller.faults import Repairs, frozen_hosts, host_id
from yatt_controller.ledger import count_driver_ray_bytes
from yatt_controller.replace import Replacer
from yatt_controller.sync import WeightSync
from yatt_controller.types import ControllerSpec, Heartbeat, StepReport
from yatt_controller.worker_group import HostPool, WorkerGroup, routed_views


class ControllerFailure(RuntimeError):
    """The run failed and will not be (or can no longer be) restarted; the message names actor and node."""


class _AttemptFailed(Exception):
    """One attempt failed. `restartable`: a dead actor or a hang (restart from a checkpoint may help); an
    error raised by the job's own code is not, and fails fast whatever `on_failure` says."""

    def __init__(self, message: str, restartable: bool) -> None:
        super().__init__(message)
        self.restartable = restartable


@dataclass
class Services:
    """What a job's `build` returns: its worker groups by name, which one is the trainer, the weight sync."""

    groups: dict[str, WorkerGroup]
    learner: str | None = None  # parallel mode runs one controller per data-parallel rank of this group
    weight_sync: WeightSync | None = None
    # other groups whose workers' state (checkpoint_state / load_checkpoint_state) every checkpoint holds,
    # like the learner's (a PPO critic); in parallel mode each needs one data-parallel rank per controller
    checkpointed: tuple[str, ...] = ()


@dataclass
class Job:
    build: Callable[[HostPool], Services]  # called on every (re)start: creates the worker groups
    step_fn: StepFn
    dataset: Callable[[], Sequence[Any]]  # called inside each controller: the driver never holds rows
    batch_size: int  # global, per step
    num_steps: int
    checkpoint_dir: str | None = None
    # called in the driver, once per step, when every controller's report of that step has arrived
    on_step: Callable[[int, list[StepReport]], None] | None = None
    # live re-placement: called in the driver after every completed step with the step and each role's busy
    # seconds since the previous call; returns None or a new PlacementPlan (same roles, other replicas),
    # applied by the controllers at the start of a later step (replace.py)
    replan: Callable[[int, dict[str, float]], Any | None] | None = None


@dataclass
class RunResult:
    reports: dict[int, list[StepReport]]  # step -> one report per controller, in rank order
    restarts: int
    failures: list[str]
    # every payload byte the driver sent or received through Ray during the run (remote-call arguments, puts,
    # gets: step reports and heartbeats included); `ledger.count_driver_ray_bytes`
    driver_bytes: int | None  # None unless `ControllerSpec.count_driver_bytes`
    report_bytes: int  # msgpack size of the step reports the driver received
    next_step: int = 0
    moves: list[tuple[int, Any]] = field(default_factory=list)  # (first step under it, plan) per live move
    replicas_replaced: int = 0  # dead service replicas replaced without a restart, over all attempts


@dataclass
class _Watch:
    label: str
    node_id: str = "?"
    last_ok: float = field(default_factory=time.time)  # last progress (controllers) or answer
    answered: bool = False  # a controller that never answered is still starting: startup_timeout_s applies
    pending: Any = None  # the outstanding heartbeat call: one at a time, never abandoned


def run(spec: ControllerSpec, job: Job, realized: Any, *, startup_timeout_s: float = 300.0) -> RunResult:
    """Run `job.num_steps` steps under `spec` on a realized placement plan. A controller that has not
    answered a heartbeat within `startup_timeout_s` of its launch counts as hung."""
    if job.batch_size < 1 or job.num_steps < 0:
        raise ValueError(
            f"Job needs batch_size >= 1 and num_steps >= 0, got {job.batch_size}, {job.num_steps}"
        )
    if spec.checkpoint_every and not job.checkpoint_dir:
        raise ValueError("ControllerSpec.checkpoint_every is set but Job.checkpoint_dir is not")
    moves: list[tuple[int, Any]] = []
    replaced: list[int] = []  # per attempt
    with count_driver_ray_bytes() if spec.count_driver_bytes else contextlib.nullcontext() as ledger:
        reports, failures, report_bytes = _attempts(spec, job, realized, startup_timeout_s, moves, replaced)
    ordered = {step: [by_rank[r] for r in sorted(by_rank)] for step, by_rank in sorted(reports.items())}
    driver_bytes = None if ledger is None else ledger.total
    return RunResult(
        ordered, len(failures), failures, driver_bytes, report_bytes, job.num_steps, moves, sum(replaced)
    )


def _attempts(
    spec: ControllerSpec, job: Job, realized: Any, startup_timeout_s: float, moves: list, replaced: list
) -> tuple[dict[int, dict[int, StepReport]], list[str], int]:
    """Attempts until one finishes or no restart is left: (reports by step and rank, failures, report bytes)."""
    reports: dict[int, dict[int, StepReport]] = {}
    failures: list[str] = []
    report_bytes = 0
    while True:
        attempt, failure = _Attempt(spec, job, realized, reports, startup_timeout_s), None
        try:
            attempt.start()
            attempt.watch()
        except _AttemptFailed as exc:
            failure = exc
        finally:
            attempt.teardown()  # collects the last reports first
            report_bytes += attempt.report_bytes
            moves += attempt.replacer.moves if attempt.replacer is not None else []
            replaced.append(attempt.replaced)
        if failure is None:
            return reports, failures, report_bytes
        failures.append(str(failure))
        if not failure.restartable or spec.on_failure == "fail" or len(failures) > spec.max_restarts:
            restarting = failure.restartable and spec.on_failure == "restart"
            tail = f" (after {len(failures) - 1} restarts)" if restarting else ""
            raise ControllerFailure(f"{failure}{tail}") from failure.__cause__


class _Attempt:
    """One launch of the job, from build to the last step or the first failure."""

    def __init__(
        self, spec: ControllerSpec, job: Job, realized: Any, reports: dict, startup_timeout_s: float
    ) -> None:
        self.spec, self.job, self.realized, self.reports = spec, job, realized, reports
        self.startup_timeout_s = startup_timeout_s
        self.pool = HostPool(realized)
        self.controllers: list[tuple[Any, _Watch]] = []
        self.runs: list[Any] = []
        self.rendezvous = None
        self.thread: threading.Thread | None = None
        self.core: ControllerCore | None = None
        self.error: BaseException | None = None
        self.report_bytes = 0
        self._nodes: dict[str, str] = {}  # label -> node id, from the last answer
        self._busy: dict[str, tuple[str, float]] = {}  # label -> (what it is doing, since)
        self.replacer: Replacer | None = None
        self.repairs: Any = None  # the Repairs actor (faults.py)
        self.frozen: set[str] = set()  # hosts whose death fails the attempt (learner, checkpointed groups)
        self.dead: dict[str, float] = {}  # replaceable hosts seen dead -> when: their repair is due
        self.seen_repairs = 0
        self.replaced = 0
        self.logged_through = -1  # every step up to this one has all its reports here (or was logged before)
        self._complete: set[int] = set()  # steps whose reports all arrived in this attempt

    def start(self) -> None:
        services = self.job.build(self.pool)
        unknown = [name for name in services.checkpointed if name not in services.groups]
        if unknown:
            raise ValueError(f"Services.checkpointed names {unknown}, not among {sorted(services.groups)}")
        if services.weight_sync is not None:
            services.weight_sync.setup()
        if self.job.replan is not None:
            self.replacer = Replacer(self.job.replan, self.realized.plan, services, self.pool)
        self.repairs = Repairs.remote()
        frozen = [*([services.learner] if services.learner else []), *services.checkpointed]
        self.frozen = frozen_hosts(services.groups, frozen)
        found = checkpoint.latest(self.job.checkpoint_dir) if self.job.checkpoint_dir else None
        path = None if found is None else str(found[0])
        if found is not None:
            self._recover(found[0], found[1].step)
        if self.spec.mode == "single":
            self._start_single(services, path)
        else:
            self._start_parallel(services, path)

    def _plan(self, services: Services, rank: int, world: int, groups: dict, learner: Any) -> ControllerPlan:
        spec, job = self.spec, self.job
        return ControllerPlan(
            rank=rank, world_size=world, step_fn=job.step_fn, dataset=job.dataset, batch_size=job.batch_size,
            shards=[rank], num_shards=world, seed=spec.seed, services=groups, learner=learner,
            weight_sync=services.weight_sync, checkpoint_dir=job.checkpoint_dir,
            checkpoint_every=spec.checkpoint_every, keep_checkpoints=spec.keep_checkpoints,
            collective_timeout_s=spec.hang_timeout_s,
            checkpointed={name: groups[name] for name in services.checkpointed},
            directory=None if self.replacer is None else self.replacer.directory, pool=self.pool,
            full_groups=dict(services.groups), learner_name=services.learner, max_inflight=spec.max_inflight,
            single=spec.mode == "single", repairs=self.repairs,
        )  # fmt: skip

    def _start_parallel(self, services: Services, path: str | None) -> None:
        world = self.spec.num_controllers
        learner = services.groups.get(services.learner) if services.learner else None
        if services.learner and learner is None:
            raise ValueError(f"Services.learner {services.learner!r} is not one of {sorted(services.groups)}")
        if learner is not None and (learner.dp_size < world or learner.dp_size % world):
            raise ValueError(
                f"num_controllers is {world} but the learner has {learner.dp_size} data-parallel ranks: each "
                "controller drives a whole block of learner ranks, so num_controllers must divide them"
            )
        for name in services.checkpointed:
            size = services.groups[name].dp_size
            if size < world or size % world:
                raise ValueError(
                    f"Services.checkpointed group {name!r} has {size} data-parallel ranks; checkpointing it "
                    f"needs a whole block of ranks per controller ({world})"
                )
        self.rendezvous = Rendezvous.remote(world)
        for rank in range(world):
            routed = routed_views(services.groups, services.learner, rank, world, self.spec.max_inflight)
            mine = routed[services.learner] if learner is not None else None
            options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
            if learner is not None:  # next to its (first) learner rank
                device = mine.workers[0].device
                options["scheduling_strategy"] = self.realized.scheduling_strategy(device)
            label = f"controller-{rank}"
            plan = self._plan(services, rank, world, routed, mine)
            actor = ControllerActor.options(**options).remote(plan, self.rendezvous, label)
            self.controllers.append((actor, _Watch(label)))
        self._await([actor.prepare.remote(path) for actor, _ in self.controllers])
        start = self._next_step(path)
        self.runs = [actor.run.remote(start, self.job.num_steps) for actor, _ in self.controllers]

    def _start_single(self, services: Services, path: str | None) -> None:
        groups = routed_views(services.groups, services.learner, 0, 1, self.spec.max_inflight, single=True)
        learner = groups.get(services.learner) if services.learner else None
        self.core = ControllerCore(self._plan(services, 0, 1, groups, learner), label="controller-0")
        self.controllers.append((None, _Watch("controller-0")))

        def body() -> None:
            try:
                start = self.core.prepare(None if path is None else Path(path))
                self.core.run(start, self.job.num_steps)
            except BaseException as exc:  # handed to the watching thread
                self.error = exc

        self.thread = threading.Thread(target=body, name="yatt-single-controller", daemon=True)
        self.thread.start()

    def _next_step(self, path: str | None) -> int:
        return 0 if path is None else checkpoint.verify(Path(path)).step + 1

    def _await(self, refs: list) -> None:
        """Wait for launch-time calls while still watching health."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=len(pending), timeout=self.spec.heartbeat_interval_s
            )
            for ref in ready:
                self._get_or_fail(ref, "a controller failed to start")
            if pending:
                self._poll_health()

    def _get_or_fail(self, ref: Any, headline: str) -> Any:
        try:
            return ray.get(ref)
        except Exception as exc:
            raise self._failure(f"{headline}: {_summary(exc)}", exc) from exc

    def watch(self) -> None:
        interval = self.spec.heartbeat_interval_s
        if self.thread is not None:
            while self.thread.is_alive():
                self.thread.join(interval)
                if self.error is not None:
                    raise self._failure(
                        f"controller-0 failed: {_summary(self.error)}", self.error
                    ) from self.error
                self._poll_health()
            if self.error is not None:
                raise self._failure(
                    f"controller-0 failed: {_summary(self.error)}", self.error
                ) from self.error
        else:
            pending = list(self.runs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=interval)
                for ref in ready:
                    rank = self.runs.index(ref)
                    self._get_or_fail(ref, f"{self.controllers[rank][1].label} failed")
                self._poll_health()
        self._drain(timeout_s=60.0)  # the last reports: the controllers are idle now

    def _poll_health(self) -> None:
        """Heartbeats of controllers (with their reports) and pings of hosts; raises on death or a hang."""
        spec = self.spec
        for actor, watch in self.controllers:
            if actor is not None and watch.pending is None:
                watch.pending = actor.heartbeat.remote(self.logged_through)
        beats = [(watch.pending, watch) for actor, watch in self.controllers if actor is not None]
        hosts = [
            (rec.handle.ping.remote(), _Watch(self._host_name(rec))) for rec in list(self.pool.hosts.values())
        ]
        refs = [ref for ref, _ in beats + hosts]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=spec.heartbeat_interval_s)
        for ref, watch in beats + hosts:
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue  # a late answer: a controller is judged by last_ok below
            watch.pending = None
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                if self._repair_due(watch):
                    continue
                raise self._failure(
                    f"actor {watch.label} on node {self._node(watch.label)} died: {_summary(exc)}"
                ) from exc
            self._seen(watch, value)
        if self.core is not None:
            self._seen(self.controllers[0][1], self.core.heartbeat(self.logged_through))
        self._adopt_repairs()
        now = time.time()
        for _, watch in self.controllers:
            limit = (
                spec.hang_timeout_s if watch.answered else max(spec.hang_timeout_s, self.startup_timeout_s)
            )
            if now - watch.last_ok > limit:
                raise self._failure(self._hang_message(watch, now))

    @staticmethod
    def _host_name(record: Any) -> str:
        return f"{record.label} ({', '.join(record.roles)})"

    def _repair_due(self, watch: _Watch) -> bool:
        """A dead host that holds no learner rank nor checkpointed group: a controller replaces it (on the
        failed call, or rank 0 before its next push); fatal only if still dead after `hang_timeout_s`."""
        record = next((r for r in self.pool.hosts.values() if self._host_name(r) == watch.label), None)
        if record is None or self.repairs is None or host_id(record.handle) in self.frozen:
            return False
        since = self.dead.setdefault(host_id(record.handle), time.time())
        return time.time() - since <= self.spec.hang_timeout_s

    def _adopt_repairs(self) -> None:
        """Hosts started by repairs take the dead ones' places in the driver's pool (pinged, torn down)."""
        if self.repairs is None:
            return
        new = ray.get(self.repairs.log.remote(self.seen_repairs))
        for repair in new:
            for record in repair.hosts:
                self.pool.hosts[record.device] = record
            self.dead.pop(repair.dead, None)
            self.replaced += repair.replicas
        self.seen_repairs += len(new)

    def _recover(self, path: Path, step: int) -> None:
        """Before resuming from the checkpoint of `step`: the steps it carries reports of (every controller's,
        for each step the driver had not logged when it was written) go to `on_step` in order, unless this
        process has had all their reports already (a restart). They are not this run's reports (`RunResult`);
        from here on every step up to `step` counts as logged."""
        saved: dict[int, dict[int, StepReport]] = {}
        for report in saved_reports(path):
            saved.setdefault(report.step, {})[report.controller_rank] = report
        for k in sorted(saved):
            by_rank = saved[k]
            had = len(self.reports.get(k, {})) == self._expected()
            if len(by_rank) == self._expected() and not had and self.job.on_step is not None:
                self.job.on_step(k, [by_rank[r] for r in sorted(by_rank)])
        self.logged_through = max(self.logged_through, step)

    def _expected(self) -> int:
        return 1 if self.spec.mode == "single" else self.spec.num_controllers

    def _take(self, report: StepReport) -> bool:
        """Record a report; when it completes its step, log the step (`on_step`). Whether it completed it."""
        by_rank = self.reports.setdefault(report.step, {})
        by_rank[report.controller_rank] = report
        if len(by_rank) != self._expected():
            return False
        if self.job.on_step is not None:
            self.job.on_step(report.step, [by_rank[r] for r in sorted(by_rank)])
        self._complete.add(report.step)
        while self.logged_through + 1 in self._complete:
            self.logged_through += 1
        return True

    def _seen(self, watch: _Watch, value: Any) -> None:
        if isinstance(value, Heartbeat):  # a host's ping
            self._nodes[watch.label] = value.node_id
            self._busy[watch.label] = (value.phase, value.time_unix)
            return
        beat, reports = value
        assert isinstance(beat, Heartbeat)
        self._nodes[beat.actor] = beat.node_id
        watch.node_id, watch.last_ok = beat.node_id, beat.time_unix
        watch.answered = beat.phase != "start"  # until its first step, a controller is still starting
        self._busy[beat.actor] = (f"step {beat.step}, phase {beat.phase!r}", beat.time_unix)
        for report in reports:
            self.report_bytes += len(msgspec.msgpack.encode(report))
            if self._take(report) and self.replacer is not None:
                self.replacer.after_step(report.step)

    def _node(self, label: str) -> str:
        return self._nodes.get(label, "?")

    def _hang_message(self, watch: _Watch, now: float) -> str:
        doing, _ = self._busy.get(watch.label, ("?", 0.0))
        busy = [
            f"{label} on node {self._node(label)} in {what} for {now - since:.1f} s"
            for label, (what, since) in self._busy.items()
            if what and since and not label.startswith("controller-")
        ]
        return (
            f"hang: {watch.label} on node {watch.node_id} made no progress for {now - watch.last_ok:.1f} s "
            f"(> hang_timeout_s {self.spec.hang_timeout_s}; {doing}); busy: {'; '.join(busy) or 'nothing'}"
        )

    def _failure(self, headline: str, exc: BaseException | None = None) -> _AttemptFailed:
        """Name every host that is dead now beside the headline. Restartable: a death or a hang, not an
        error raised by the job's code."""
        refs = [(rec.handle.ping.remote(), self._host_name(rec)) for rec in list(self.pool.hosts.values())]
        if refs:
            ray.wait(
                [r for r, _ in refs], num_returns=len(refs), timeout=min(5.0, self.spec.heartbeat_interval_s)
            )
        dead = []
        for ref, label in refs:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                dead.append(f"{label} on node {self._node(label)}")
            except ray.exceptions.GetTimeoutError:
                pass
        suffix = f"; dead actors: {', '.join(dead)}" if dead and not headline.startswith("actor ") else ""
        died = exc is None or bool(dead) or _is_death(exc)
        return _AttemptFailed(headline + suffix, restartable=died)

    def _drain(self, timeout_s: float = 5.0) -> None:
        """Collect every report not yet seen: the outstanding heartbeats' and a fresh one's (a controller
        drains its reports into whichever heartbeat answers first). Best effort after a failure."""
        live = []
        for actor, watch in self.controllers:
            if actor is not None:
                live += [
                    (ref, watch)
                    for ref in (watch.pending, actor.heartbeat.remote(self.logged_through))
                    if ref is not None
                ]
                watch.pending = None
        if live:
            ray.wait([ref for ref, _ in live], num_returns=len(live), timeout=timeout_s)
        for ref, watch in live:
            with contextlib.suppress(Exception):
                self._seen(watch, ray.get(ref, timeout=0))
        if self.core is not None:
            self._seen(self.controllers[0][1], self.core.heartbeat(self.logged_through))

    def teardown(self) -> None:
        self._drain()
        if self.replacer is not None:
            self.replacer.close()  # the moves made, and the hosts they started, into the pool torn down below
        if self.repairs is not None:
            with contextlib.suppress(Exception):  # best effort after a failure: hosts repairs started
                self._adopt_repairs()
            ray.kill(self.repairs, no_restart=True)
        for actor, _ in self.controllers:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.rendezvous is not None:
            ray.kill(self.rendezvous, no_restart=True)
        self.pool.shutdown()  # a single-mode thread blocked on a host now gets an error and ends
        if self.thread is not None:
            self.thread.join(timeout=10.0)


def _is_death(exc: BaseException) -> bool:
    """An actor died under this error (a RayTaskError wrapping ActorDiedError is one too)."""
    return isinstance(exc, ray.exceptions.RayActorError) or isinstance(
        getattr(exc, "cause", None), ray.exceptions.RayActorError
    )


def _summary(exc: BaseException) -> str:
    """The exception's type and its first line: enough to name the cause, short enough to read."""
    cause = getattr(exc, "cause", None) or exc  # a RayTaskError wraps the error raised in the task
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"[:300]
