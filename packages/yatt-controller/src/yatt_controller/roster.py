"""The roster: which replica of which role lives on which host and device, versioned, with its history.

One record owns the replicas of a run. `Roster` holds the whole worker groups (every replica of every role),
the version (0 at launch, +1 for every replacement), the history of replacements (`Change`: a live move the
re-planner asked for, or the repair of a dead replica), and the host processes replacements started.
`Roster.replaceable` is the one place that says which groups may be replaced: never the learner nor a
checkpointed group (their workers' state is in the checkpoints; their death restarts the run from one).

`RosterBook` keeps the current roster for every process of the run: it grants one replacement at a time
(`claim`), takes the new version (`finish`), hands newer versions to whoever asks (`newer`), and is the mailbox
of plans the driver's re-planner posts for rank 0 (`post`, `take`). It lives in the attempt's one small Ray
actor (`AttemptBookActor`), with the controllers' rendezvous (`yatt_controller.collective.Rendezvous`): one
process per attempt for both (each Ray actor is a Python process of its own, ~0.8 s of CPU to start).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from yatt_controller.collective import Rendezvous
from yatt_controller.worker_group import HostRecord, WorkerGroup, host_id


@dataclass(frozen=True)
class Seat:
    """Where one worker sits: replica `replica` (the group's dp rank) of `group`, tp rank, device, host id."""

    group: str
    replica: int
    tp_rank: int
    device: int
    host: str


@dataclass(frozen=True)
class Change:
    """One replacement: the roster version it made, the step it happened in, why ("move" or "repair"), the
    groups it changed, the replicas it started, and the plan (a move) or the dead host's id (a repair)."""

    version: int
    step: int
    cause: str
    groups: tuple[str, ...]
    replicas: int
    plan: Any = None
    dead: str = ""


@dataclass
class Roster:
    """Every replica of the run, versioned. Replacements make a new roster (`after`); nothing edits one."""

    groups: dict[str, WorkerGroup]
    learner: str | None = None
    checkpointed: tuple[str, ...] = ()
    version: int = 0
    history: tuple[Change, ...] = ()
    hosts: tuple[HostRecord, ...] = field(default=())  # host processes that replacements started

    def fixed_because(self, name: str) -> str | None:
        """Why group `name` may never be replaced, or None. THE rule: the learner and the checkpointed groups
        hold state the checkpoints carry; replacing a replica would lose it (their death is a restart)."""
        if name == self.learner:
            return "the learner"
        if name in self.checkpointed:
            return "checkpointed"
        return None

    def replaceable(self, name: str) -> bool:
        """Whether the replicas of group `name` may be replaced (moved or repaired)."""
        return name in self.groups and self.fixed_because(name) is None

    def seats(self) -> list[Seat]:
        return [
            Seat(name, w.group_dp_rank, w.tp_rank, w.device, host_id(w.host))
            for name, group in self.groups.items()
            for w in group.workers
        ]

    def fixed_hosts(self) -> set[str]:
        """Ids of the host processes holding a worker of a group that may not be replaced."""
        return {seat.host for seat in self.seats() if not self.replaceable(seat.group)}

    def on_host(self, host: str) -> list[str]:
        """The groups with a worker on host `host`, in roster order."""
        return sorted({seat.group for seat in self.seats() if seat.host == host}, key=list(self.groups).index)

    def after(self, change: Change, groups: dict[str, WorkerGroup], hosts: list[HostRecord]) -> Roster:
        """The next version: `groups` replace theirs, `change` joins the history, new hosts are recorded."""
        assert change.version == self.version + 1, "a roster version follows the one it replaces"
        return replace(
            self,
            groups={**self.groups, **groups},
            version=change.version,
            history=(*self.history, change),
            hosts=(*self.hosts, *hosts),
        )

    @property
    def moves(self) -> list[tuple[int, Any]]:
        """(step it was applied at, plan) of every live move."""
        return [(c.step, c.plan) for c in self.history if c.cause == "move"]

    @property
    def replicas_replaced(self) -> int:
        """Dead replicas started again without a restart."""
        return sum(c.replicas for c in self.history if c.cause == "repair")


class RosterBook:
    """The attempt's current roster, hosted as a Ray actor: one replacement at a time, newer versions to
    whoever asks, and the re-planner's mailbox."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        self._active: str | None = None  # what is being replaced now (a dead host's id, or "move")
        self._since = 0.0
        self._plan: Any = None

    def claim(self, what: str) -> tuple[str, Roster | None]:
        """("done", roster) when the dead host `what` was replaced already; ("mine", roster) to the caller
        that may replace now (it builds on that roster); ("wait", None) while another replacement runs."""
        if any(c.dead == what for c in self._roster.history):
            return "done", self._roster
        if self._active is not None:
            return "wait", None
        self._active, self._since = what, time.time()
        return "mine", self._roster

    def finish(self, roster: Roster) -> None:
        self._roster, self._active = roster, None

    def abandon(self, what: str) -> None:
        if self._active == what:
            self._active = None

    def newer(self, version: int) -> Roster | None:
        """The current roster when it is newer than `version`."""
        return self._roster if self._roster.version > version else None

    def post(self, plan: Any) -> None:
        self._plan = plan  # a later plan replaces one not taken yet

    def take(self) -> Any:
        plan, self._plan = self._plan, None
        return plan


class AttemptBook(RosterBook, Rendezvous):
    """The attempt's roster book and its controllers' rendezvous, one actor. `exchange` is a coroutine, so
    Ray runs the actor on an event loop; the book's methods are quick and run there between awaits."""

    def __init__(self, roster: Roster, world_size: int) -> None:
        self.reset(roster, world_size)

    def reset(self, roster: Roster, world_size: int) -> None:
        """Start over for another attempt (a kept book: `yatt_controller.warm.take_book`)."""
        RosterBook.__init__(self, roster)
        Rendezvous.__init__(self, world_size)


AttemptBookActor = ray.remote(num_cpus=0)(AttemptBook)
