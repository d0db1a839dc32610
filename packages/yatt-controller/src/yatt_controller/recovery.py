"""Recovering from a checkpoint: where an attempt resumes, the reports a checkpoint carries, and whether a
failed attempt is restarted.

A restart builds the job on its original plan again and resumes from the newest complete checkpoint (a run
that moved replicas is re-planned, not resumed into the moved layout: the re-planner sees fresh busy times
and may move again). Learner, checkpointed-group and controller deaths restart; so does a hang; an error
raised by the job's own code fails fast whatever `on_failure` says.
"""

from __future__ import annotations

from pathlib import Path

from yatt_controller import checkpoint
from yatt_controller.controller import saved_reports
from yatt_controller.health import AttemptFailed
from yatt_controller.reports import ReportLog
from yatt_controller.types import ControllerSpec, StepReport


class ControllerFailure(RuntimeError):
    """The run failed and will not be (or can no longer be) restarted; the message names actor and node."""


def resume_point(checkpoint_dir: str | None) -> Path | None:
    """The newest checkpoint of the run that verifies, or None (a fresh start: there is none). Newer ones
    that do not verify are named on stderr with why; `checkpoint.NoValidCheckpoint` when none verifies."""
    found = checkpoint.resumable(checkpoint_dir) if checkpoint_dir else None
    return None if found is None else found[0]


def next_step(path: Path | None) -> int:
    """The first step an attempt resumed from `path` runs."""
    return 0 if path is None else checkpoint.verify(path).step + 1


def replay_saved_reports(path: Path, log: ReportLog) -> None:
    """Before resuming from the checkpoint at `path`: the steps it carries reports of (every controller's, for
    each step the driver had not logged when it was written) go to `on_step` in order, unless this run has
    logged them already (a restart). They are not this run's reports (`RunResult`); from here
    on every step up to the checkpoint's counts as logged."""
    saved: dict[int, dict[int, StepReport]] = {}
    for report in saved_reports(path):
        saved.setdefault(report.step, {})[report.controller_rank] = report
    for step in sorted(saved):
        log.replay(step, saved[step])
    log.logged_through = max(log.logged_through, checkpoint.verify(path).step)


def check_restart(failure: AttemptFailed, spec: ControllerSpec, failures: list[str]) -> None:
    """Raise `ControllerFailure` unless the failed attempt (the last of `failures`) is to be restarted."""
    if failure.restartable and spec.on_failure == "restart" and len(failures) <= spec.max_restarts:
        return
    restarting = failure.restartable and spec.on_failure == "restart"
    tail = f" (after {len(failures) - 1} restarts)" if restarting else ""
    raise ControllerFailure(f"{failure}{tail}") from failure.__cause__
