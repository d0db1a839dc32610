"""One attempt of a run: from building the services to the last step or the first failure.

`Attempt.start()` builds the job's services on the host pool, makes the roster and its book, replays the
reports the resumed checkpoint carries, and launches the controllers (startup.py); `watch()` polls health
(health.py) and takes reports (reports.py) until every controller finished; `teardown()` collects the last
reports and kills every actor of the attempt.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import ray

from yatt_controller import recovery, warm
from yatt_controller.health import Health, Watch, summary
from yatt_controller.replan import Replanner
from yatt_controller.reports import ReportLog
from yatt_controller.roster import AttemptBookActor, Roster
from yatt_controller.startup import (
    HostedController,
    Launcher,
    SingleController,
    check_services,
    make_roster,
)
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool

if TYPE_CHECKING:
    from yatt_controller.runner import Job


class Attempt:
    """One launch of the job: its pool, roster, controllers and health."""

    def __init__(
        self, spec: ControllerSpec, job: Job, realized: Any, log: ReportLog, startup_timeout_s: float
    ) -> None:
        self.spec, self.job, self.realized, self.log = spec, job, realized, log
        self.pool = HostPool(realized)
        self.health = Health(spec, self.pool, startup_timeout_s)
        self.controllers: list[tuple[Any, Watch]] = []
        self.runs: list[Any] = []
        self.single: SingleController | None = None
        self.book: Any = None
        self.roster: Roster | None = None
        self.replanner: Replanner | None = None
        log.new_attempt()

    def start(self) -> None:
        services = self.job.build(self.pool)
        check_services(services, self.spec)
        if services.weight_sync is not None:
            services.weight_sync.setup()
        self.roster = make_roster(services)
        self.health.roster = self.roster
        self.book = warm.take_book(self.roster, self.spec.num_controllers)
        if self.book is None:
            self.book = AttemptBookActor.remote(self.roster, self.spec.num_controllers)
        if self.job.replan is not None:
            self.replanner = Replanner(self.job.replan, self.realized.plan, self.book, self.pool)
        path = recovery.resume_point(self.job.checkpoint_dir)
        if path is not None:
            recovery.replay_saved_reports(path, self.log)
        launcher = Launcher(self.spec, self.job, services, self.roster, self.book, self.pool)
        if self.spec.mode == "single":
            self.single = SingleController(launcher, path, self.job.num_steps)
            self.controllers.append((None, Watch("controller-0")))
            return
        self.controllers, created = launcher.parallel()
        for ref in created:  # hosted controllers exist before their first call (a host's calls overlap)
            self._get_or_fail(ref, "a controller failed to start")
        self._await(
            [actor.prepare.remote(None if path is None else str(path)) for actor, _ in self.controllers]
        )
        start = recovery.next_step(path)
        self.runs = [actor.run.remote(start, self.job.num_steps) for actor, _ in self.controllers]

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
                self._poll()

    def _get_or_fail(self, ref: Any, headline: str) -> Any:
        try:
            return ray.get(ref)
        except Exception as exc:
            raise self.health.failure(f"{headline}: {summary(exc)}", exc) from exc

    def watch(self) -> None:
        interval, single = self.spec.heartbeat_interval_s, self.single
        if single is not None:
            while single.thread.is_alive():
                single.thread.join(interval)
                self._raise_single()
                self._poll()
            self._raise_single()
        else:
            pending = list(self.runs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=interval)
                for ref in ready:
                    rank = self.runs.index(ref)
                    self._get_or_fail(ref, f"{self.controllers[rank][1].label} failed")
                self._poll()
        self._drain(timeout_s=60.0)  # the last reports: the controllers are idle now

    def _raise_single(self) -> None:
        error = None if self.single is None else self.single.error
        if error is not None:
            raise self.health.failure(f"controller-0 failed: {summary(error)}", error) from error

    def _poll(self) -> None:
        """Heartbeats (with their reports) and pings; the newest roster; raises on a death or a hang."""
        reports = self.health.poll(self.controllers, self.log.logged_through)
        if self.single is not None:
            beat = self.single.core.heartbeat(self.log.logged_through)
            reports += self.health.seen(self.controllers[0][1], beat)
        self._refresh_roster()
        self._take(reports)
        self.health.check_hangs(self.controllers)

    def _take(self, reports: list) -> None:
        for report in reports:
            if self.log.take(report) and self.replanner is not None and self.roster is not None:
                self.replanner.after_step(report.step, self.roster, report.timings_s.get("step", 0.0))

    def _refresh_roster(self) -> None:
        """The newest roster version: hosts replacements started join the driver's pool (pinged, torn down)."""
        if self.book is None or self.roster is None:
            return
        newer = ray.get(self.book.newer.remote(self.roster.version))
        if newer is not None:
            self.roster = newer
            self.health.adopt(newer)

    def _drain(self, timeout_s: float = 5.0) -> None:
        """Collect every report not yet seen: the outstanding heartbeats' and a fresh one's (a controller
        drains its reports into whichever heartbeat answers first). Best effort after a failure."""
        live = []
        for actor, watch in self.controllers:
            if actor is not None:
                refs = (watch.pending, actor.heartbeat.remote(self.log.logged_through))
                live += [(ref, watch) for ref in refs if ref is not None]
                watch.pending = None
        if live:
            ray.wait([ref for ref, _ in live], num_returns=len(live), timeout=timeout_s)
        reports = []
        for ref, watch in live:
            with contextlib.suppress(Exception):
                reports += self.health.seen(watch, ray.get(ref, timeout=0))
        if self.single is not None:
            reports += self.health.seen(
                self.controllers[0][1], self.single.core.heartbeat(self.log.logged_through)
            )
        self._take(reports)

    def teardown(self, *, keep_hosts: bool = False) -> None:
        """Collect the last reports, then kill the attempt's actors; with `keep_hosts` (a finished attempt)
        its hosts are parked for the next job instead (`yatt_controller.warm`)."""
        self._drain()
        if self.book is not None:
            with contextlib.suppress(Exception):  # best effort after a failure: hosts replacements started
                self._refresh_roster()
        for actor, _ in self.controllers:
            if actor is not None and not isinstance(actor, HostedController):  # that one ends with its host
                ray.kill(actor, no_restart=True)
        if self.book is not None and keep_hosts:  # the roster book and the controllers' rendezvous
            warm.park_book(self.book)
        elif self.book is not None:
            ray.kill(self.book, no_restart=True)
        # a single-mode thread blocked on a host now gets an error and ends
        self.pool.shutdown(park=keep_hosts)
        if self.single is not None:
            self.single.thread.join(timeout=10.0)
