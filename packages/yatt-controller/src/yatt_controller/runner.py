"""The run: launch the controllers, watch their health, restart from the last checkpoint or fail fast.

`run(spec, job, realized)` runs attempts (attempt.py) until one finishes: each builds the job's services on
the realized plan, starts the controllers (startup.py: one actor per block of learner ranks in parallel mode;
one core on a driver thread in single mode), and then only watches (health.py) and takes reports
(reports.py). A dead actor, a failed controller, or no progress for `hang_timeout_s` tears the attempt down;
with `on_failure="restart"` the run is rebuilt and resumed from the newest complete checkpoint, up to
`max_restarts` times (recovery.py); otherwise `ControllerFailure` names the actor and its node. Never a
silent hang. Replicas replaced during an attempt (moves and repairs) are read from its roster's history.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from yatt_controller import warm
from yatt_controller.attempt import Attempt
from yatt_controller.controller import StepFn
from yatt_controller.health import AttemptFailed
from yatt_controller.ledger import count_driver_ray_bytes
from yatt_controller.recovery import ControllerFailure, check_restart
from yatt_controller.reports import ReportLog
from yatt_controller.sync import WeightSync
from yatt_controller.types import ControllerSpec, StepReport
from yatt_controller.worker_group import HostPool, WorkerGroup

__all__ = ["ControllerFailure", "Job", "RunResult", "Services", "run"]


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
    # live re-placement: called in the driver after every completed step with the step, each role's busy
    # seconds since the previous call and the step's wall seconds; returns None or a new PlacementPlan (same roles, other replicas),
    # applied by the controllers at the start of a later step (replan.py, replace.py)
    replan: Callable[[int, dict[str, float], float], Any | None] | None = None
    # the push that gives the engines the learner's weights when an attempt starts (fresh or resumed), called
    # on every controller together with its StepContext and the version the engines get (e.g. streamed one
    # bucket at a time, every learner rank gathering together); None: rank 0 pushes what the weight sync reads
    initial_push: Callable[[Any, int], None] | None = None


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


def run(
    spec: ControllerSpec,
    job: Job,
    realized: Any,
    *,
    startup_timeout_s: float = 300.0,
    keep_hosts: bool | None = None,
) -> RunResult:
    """Run `job.num_steps` steps under `spec` on a realized placement plan. A controller that has not
    answered a heartbeat within `startup_timeout_s` of its launch counts as hung. Driver bytes are counted
    (Ray's API wrapped) only inside this call and only when `spec.count_driver_bytes`. With `keep_hosts`
    (default: `warm.enabled()`, the YATT_KEEP_HOSTS switch) the hosts of the attempt that finishes are parked
    for the next job on the same bundles instead of killed (`yatt_controller.warm`)."""
    if job.batch_size < 1 or job.num_steps < 0:
        raise ValueError(
            f"Job needs batch_size >= 1 and num_steps >= 0, got {job.batch_size}, {job.num_steps}"
        )
    if spec.checkpoint_every and not job.checkpoint_dir:
        raise ValueError("ControllerSpec.checkpoint_every is set but Job.checkpoint_dir is not")
    log = ReportLog(1 if spec.mode == "single" else spec.num_controllers, job.on_step)
    result = RunResult({}, 0, [], None, 0, job.num_steps)
    with count_driver_ray_bytes() if spec.count_driver_bytes else contextlib.nullcontext() as ledger:
        keep = warm.enabled() if keep_hosts is None else keep_hosts
        _attempts(spec, job, realized, startup_timeout_s, log, result, keep)
    result.reports, result.report_bytes = log.ordered(), log.report_bytes
    result.driver_bytes = None if ledger is None else ledger.total
    return result


def _attempts(
    spec: ControllerSpec,
    job: Job,
    realized: Any,
    startup_timeout_s: float,
    log: ReportLog,
    result: RunResult,
    keep_hosts: bool,
) -> None:
    """Attempts until one finishes or no restart is left; failures, moves and replacements into `result`."""
    while True:
        attempt, failure, finished = Attempt(spec, job, realized, log, startup_timeout_s), None, False
        try:
            attempt.start()
            attempt.watch()
            finished = True
        except AttemptFailed as exc:
            failure = exc
        finally:
            attempt.teardown(keep_hosts=keep_hosts and finished)  # collects the last reports first
            if attempt.roster is not None:
                result.moves += attempt.roster.moves
                result.replicas_replaced += attempt.roster.replicas_replaced
        if failure is None:
            return
        result.failures.append(str(failure))
        result.restarts = len(result.failures)
        check_restart(failure, spec, result.failures)
