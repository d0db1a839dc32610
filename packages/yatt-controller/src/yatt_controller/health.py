"""Watching health and hangs: controllers' heartbeats (which carry their step reports) and pings of every
host, every `heartbeat_interval_s`.

A dead actor, a failed controller, or no progress for `hang_timeout_s` fails the attempt with a message that
names the actor, its node and what every busy host was doing. A dead host that holds only replaceable
replicas (the roster decides) is not a failure while a controller replaces it: only if it stays dead for
`hang_timeout_s`. Never a silent hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from yatt_controller.roster import Roster, host_id
from yatt_controller.types import ControllerSpec, Heartbeat, StepReport
from yatt_controller.worker_group import HostPool, HostRecord


class AttemptFailed(Exception):
    """One attempt failed. `restartable`: a dead actor or a hang (restart from a checkpoint may help); an
    error raised by the job's own code is not, and fails fast whatever `on_failure` says."""

    def __init__(self, message: str, restartable: bool) -> None:
        super().__init__(message)
        self.restartable = restartable


@dataclass
class Watch:
    label: str
    node_id: str = "?"
    last_ok: float = field(default_factory=time.time)  # last progress (controllers) or answer
    answered: bool = False  # a controller that never answered is still starting: startup_timeout_s applies
    pending: Any = None  # the outstanding heartbeat call: one at a time, never abandoned


def host_name(record: HostRecord) -> str:
    return f"{record.label} ({', '.join(record.roles)})"


class Health:
    """The driver's view of every actor of an attempt: last answers, nodes, what each is busy with."""

    def __init__(self, spec: ControllerSpec, pool: HostPool, startup_timeout_s: float) -> None:
        self.spec, self.pool, self.startup_timeout_s = spec, pool, startup_timeout_s
        self.roster: Roster | None = None  # the newest roster the driver has seen: who may be replaced
        self._nodes: dict[str, str] = {}  # label -> node id, from the last answer
        self._busy: dict[str, tuple[str, float]] = {}  # label -> (what it is doing, since)
        self.dead: dict[str, float] = {}  # replaceable hosts seen dead -> since when: their repair is due

    def poll(self, controllers: list[tuple[Any, Watch]], logged_through: int) -> list[StepReport]:
        """One round: a heartbeat of every controller actor, a ping of every host. Returns the step reports
        the answers carried; raises AttemptFailed on a death."""
        for actor, watch in controllers:
            if actor is not None and watch.pending is None:
                watch.pending = actor.heartbeat.remote(logged_through)
        beats = [(watch.pending, watch) for actor, watch in controllers if actor is not None]
        hosts = [(rec.handle.ping.remote(), Watch(host_name(rec))) for rec in list(self.pool.hosts.values())]
        refs = [ref for ref, _ in beats + hosts]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.spec.heartbeat_interval_s)
        reports: list[StepReport] = []
        for ref, watch in beats + hosts:
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue  # a late answer: a controller is judged by last_ok
            watch.pending = None
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                if self._repair_due(watch.label):
                    continue
                raise self.failure(
                    f"actor {watch.label} on node {self.node(watch.label)} died: {summary(exc)}"
                ) from exc
            reports += self.seen(watch, value)
        return reports

    def seen(self, watch: Watch, value: Any) -> list[StepReport]:
        """Note an answer; the step reports a controller's heartbeat carried."""
        if isinstance(value, Heartbeat):  # a host's ping
            self._nodes[watch.label] = value.node_id
            self._busy[watch.label] = (value.phase, value.time_unix)
            return []
        beat, reports = value
        self._nodes[beat.actor] = beat.node_id
        watch.node_id, watch.last_ok = beat.node_id, beat.time_unix
        watch.answered = beat.phase != "start"  # until its first step, a controller is still starting
        self._busy[beat.actor] = (f"step {beat.step}, phase {beat.phase!r}", beat.time_unix)
        return list(reports)

    def check_hangs(self, controllers: list[tuple[Any, Watch]]) -> None:
        now, spec = time.time(), self.spec
        for _, watch in controllers:
            limit = (
                spec.hang_timeout_s if watch.answered else max(spec.hang_timeout_s, self.startup_timeout_s)
            )
            if now - watch.last_ok > limit:
                raise self.failure(self._hang_message(watch, now))

    def _repair_due(self, label: str) -> bool:
        """A dead host that holds only replicas the roster may replace: a controller replaces it (on the
        failed call, or rank 0 before its next push); fatal only if still dead after `hang_timeout_s`."""
        record = next((r for r in self.pool.hosts.values() if host_name(r) == label), None)
        if record is None or self.roster is None or host_id(record.handle) in self.roster.fixed_hosts():
            return False
        since = self.dead.setdefault(host_id(record.handle), time.time())
        return time.time() - since <= self.spec.hang_timeout_s

    def adopt(self, roster: Roster) -> None:
        """A newer roster: its new hosts take the dead ones' places in the pool (pinged, torn down)."""
        self.roster = roster
        for record in roster.hosts:
            self.pool.hosts[record.device] = record
        for change in roster.history:
            self.dead.pop(change.dead, None)

    def node(self, label: str) -> str:
        """The node of an actor: from its last answer, else (a host that died before answering) from the
        placement group's bundle of its device."""
        if label in self._nodes:
            return self._nodes[label]
        record = next((r for r in self.pool.hosts.values() if host_name(r) == label), None)
        group = getattr(self.pool.realized, "placement_group", None)
        if record is None or group is None:
            return "?"
        try:
            nodes = ray.util.placement_group_table(group).get("bundles_to_node_id", {})
        except Exception:  # best effort: this only names a node in a failure message
            return "?"
        return str(nodes.get(record.device, "?"))

    def _hang_message(self, watch: Watch, now: float) -> str:
        doing, _ = self._busy.get(watch.label, ("?", 0.0))
        busy = [
            f"{label} on node {self.node(label)} in {what} for {now - since:.1f} s"
            for label, (what, since) in self._busy.items()
            if what and since and not label.startswith("controller-")
        ]
        return (
            f"hang: {watch.label} on node {watch.node_id} made no progress for {now - watch.last_ok:.1f} s "
            f"(> hang_timeout_s {self.spec.hang_timeout_s}; {doing}); busy: {'; '.join(busy) or 'nothing'}"
        )

    def failure(self, headline: str, exc: BaseException | None = None) -> AttemptFailed:
        """Name every host that is dead now beside the headline. Restartable: a death or a hang, not an
        error raised by the job's code."""
        refs = [(rec.handle.ping.remote(), host_name(rec)) for rec in list(self.pool.hosts.values())]
        if refs:
            timeout = min(5.0, self.spec.heartbeat_interval_s)
            ray.wait([r for r, _ in refs], num_returns=len(refs), timeout=timeout)
        dead = []
        for ref, label in refs:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                dead.append(f"{label} on node {self.node(label)}")
            except ray.exceptions.GetTimeoutError:
                pass
        suffix = f"; dead actors: {', '.join(dead)}" if dead and not headline.startswith("actor ") else ""
        died = exc is None or bool(dead) or _is_death(exc)
        return AttemptFailed(headline + suffix, restartable=died)


def _is_death(exc: BaseException) -> bool:
    """An actor died under this error (a RayTaskError wrapping ActorDiedError is one too)."""
    return isinstance(exc, ray.exceptions.RayActorError) or isinstance(
        getattr(exc, "cause", None), ray.exceptions.RayActorError
    )


def summary(exc: BaseException) -> str:
    """The exception's type and its first line: enough to name the cause, short enough to read."""
    cause = getattr(exc, "cause", None) or exc  # a RayTaskError wraps the error raised in the task
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"[:300]
