"""Taking reports and logging: every controller's step report arrives with its heartbeats; a step whose
reports have all arrived is handed to the job's `on_step` (the driver's logging), in the order they complete.

`ReportLog` lives for the whole run (all attempts), and every step is logged once in it. A restart resumes
from a checkpoint: the steps whose reports the checkpoint carries are logged if they were not (`replay`), and
a step that ran again because its checkpoint was not complete when the attempt failed is not logged again
(its new reports replace the old in `reports`, what `RunResult` carries).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from yatt_controller.types import StepReport

OnStep = Callable[[int, list[StepReport]], None]


class ReportLog:
    """Reports by step and controller rank; `expected` reports complete a step. `logged_through`: every step
    up to it has all its reports here (or was logged before): what heartbeats tell the controllers."""

    def __init__(self, expected: int, on_step: OnStep | None) -> None:
        self.expected, self.on_step = expected, on_step
        self.reports: dict[int, dict[int, StepReport]] = {}
        self.report_bytes = 0  # msgpack size of every report received
        self.logged_through = -1
        self._arrived: dict[int, dict[int, StepReport]] = {}  # this attempt's reports
        self._complete: set[int] = set()  # steps whose reports all arrived in this attempt
        self._logged: set[int] = set()  # steps handed to `on_step` in any attempt

    def new_attempt(self) -> None:
        self.logged_through, self._arrived, self._complete = -1, {}, set()

    def take(self, report: StepReport) -> bool:
        """Record a report; when it completes its step, log the step (`on_step`). Whether it completed it."""
        self.report_bytes += len(msgspec.msgpack.encode(report))
        self.reports.setdefault(report.step, {})[report.controller_rank] = report
        by_rank = self._arrived.setdefault(report.step, {})
        by_rank[report.controller_rank] = report
        if len(by_rank) != self.expected:
            return False
        self._log(report.step, by_rank)
        self._complete.add(report.step)
        while self.logged_through + 1 in self._complete:
            self.logged_through += 1
        return True

    def replay(self, step: int, by_rank: dict[int, StepReport]) -> None:
        """A step's reports read from a checkpoint: logged unless incomplete or logged already."""
        if len(by_rank) == self.expected:
            self._log(step, by_rank)

    def _log(self, step: int, by_rank: dict[int, StepReport]) -> None:
        if step not in self._logged and self.on_step is not None:
            self.on_step(step, [by_rank[r] for r in sorted(by_rank)])
        self._logged.add(step)

    def ordered(self) -> dict[int, list[StepReport]]:
        """Step -> one report per controller, in rank order."""
        return {step: [by_rank[r] for r in sorted(by_rank)] for step, by_rank in sorted(self.reports.items())}
