"""Starting an attempt: the job's services checked, the roster made, one plan per controller, and the
controllers launched (one actor per block of learner ranks in parallel mode; one core on a driver thread in
single mode)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yatt_controller.controller import Controller, ControllerActor, ControllerCore, ControllerPlan
from yatt_controller.health import Watch
from yatt_controller.roster import Roster
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool, WorkerGroup, routed_views

if TYPE_CHECKING:
    from yatt_controller.runner import Job, Services


def check_services(services: Services, spec: ControllerSpec) -> None:
    """ValueError naming the field when the services cannot run under `spec`."""
    unknown = [name for name in services.checkpointed if name not in services.groups]
    if unknown:
        raise ValueError(f"Services.checkpointed names {unknown}, not among {sorted(services.groups)}")
    if services.learner and services.learner not in services.groups:
        raise ValueError(f"Services.learner {services.learner!r} is not one of {sorted(services.groups)}")
    if spec.mode == "single":
        return
    world = spec.num_controllers
    if services.learner:
        size = services.groups[services.learner].dp_size
        if size < world or size % world:
            raise ValueError(
                f"num_controllers is {world} but the learner has {size} data-parallel ranks: each "
                "controller drives a whole block of learner ranks, so num_controllers must divide them"
            )
    for name in services.checkpointed:
        size = services.groups[name].dp_size
        if size < world or size % world:
            raise ValueError(
                f"Services.checkpointed group {name!r} has {size} data-parallel ranks; checkpointing it "
                f"needs a whole block of ranks per controller ({world})"
            )


def make_roster(services: Services) -> Roster:
    return Roster(dict(services.groups), services.learner, tuple(services.checkpointed))


class Launcher:
    """Builds every controller's plan and starts the controllers of one attempt."""

    def __init__(
        self, spec: ControllerSpec, job: Job, services: Services, roster: Roster, book: Any, pool: HostPool
    ) -> None:
        self.spec, self.job, self.services = spec, job, services
        self.roster, self.book, self.pool = roster, book, pool

    def plan(self, rank: int, world: int, groups: dict[str, WorkerGroup]) -> ControllerPlan:
        spec, job, services = self.spec, self.job, self.services
        return ControllerPlan(
            rank=rank,
            world_size=world,
            step_fn=job.step_fn,
            dataset=job.dataset,
            batch_size=job.batch_size,
            shards=[rank],
            num_shards=world,
            seed=spec.seed,
            services=groups,
            learner=groups.get(services.learner) if services.learner else None,
            weight_sync=services.weight_sync,
            checkpoint_dir=job.checkpoint_dir,
            checkpoint_every=spec.checkpoint_every,
            keep_checkpoints=spec.keep_checkpoints,
            checkpoint_async=spec.checkpoint_async,
            collective_timeout_s=spec.hang_timeout_s,
            checkpointed={name: groups[name] for name in services.checkpointed},
            initial_push=job.initial_push,
            book=self.book,
            roster=self.roster,
            movable=job.replan is not None,
            pool=self.pool,
            learner_name=services.learner,
            max_inflight=spec.max_inflight,
            single=spec.mode == "single",
        )

    def parallel(self) -> tuple[list[tuple[Any, Watch]], list[Any]]:
        """(one (controller handle, watch) per rank, the refs to wait for before the first call). The
        controllers meet at the attempt's book (`AttemptBook`: the roster book is their rendezvous too). Each
        controller lives in the host process of its (first) learner rank's device, beside that rank, and costs
        no process of its own; with `ControllerSpec.hosted` off, or in a job without a learner, each gets a
        process of its own."""
        world, learner = self.spec.num_controllers, self.services.learner
        controllers: list[tuple[Any, Watch]] = []
        created = []
        for rank in range(world):
            routed = routed_views(self.services.groups, learner, rank, world, self.spec.max_inflight)
            label, plan = f"controller-{rank}", self.plan(rank, world, routed)
            handle: Any
            if learner and self.spec.hosted:
                host = self.pool.host(routed[learner].workers[0].device, label).handle
                created.append(host.create.remote(label, Controller, (plan, self.book, label), {}, label))
                handle = HostedController(host, label)
            else:
                options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
                if learner:  # next to its (first) learner rank
                    options["scheduling_strategy"] = self.pool.realized.scheduling_strategy(
                        routed[learner].workers[0].device
                    )
                handle = ControllerActor.options(**options).remote(plan, self.book, label)
            controllers.append((handle, Watch(label)))
        return controllers, created


class _HostedCall:
    """`handle.method.remote(*args)` of a hosted controller: a call of its host."""

    def __init__(self, host: Any, key: str, method: str, via: str) -> None:
        self.host, self.key, self.method, self.via = host, key, method, via

    def remote(self, *args: Any) -> Any:
        return getattr(self.host, self.via).remote(self.key, self.method, args)


class HostedController:
    """The driver's handle of a controller hosted in a `_Host` process: the calls of a `ControllerActor`
    handle (`prepare`, `run` under the controller's lock; `heartbeat` on the host's health thread). It dies
    with its host, which the pool's shutdown ends (there is no process of its own to kill)."""

    def __init__(self, host: Any, key: str) -> None:
        self.prepare = _HostedCall(host, key, "prepare", "serve")
        self.run = _HostedCall(host, key, "run", "serve")
        self.heartbeat = _HostedCall(host, key, "heartbeat", "peek")


class SingleController:
    """Single mode: one core in the driver, on a thread of its own; its error is handed to the watcher."""

    def __init__(self, launcher: Launcher, path: Path | None, num_steps: int) -> None:
        spec, services = launcher.spec, launcher.services
        groups = routed_views(services.groups, services.learner, 0, 1, spec.max_inflight, single=True)
        self.core = ControllerCore(launcher.plan(0, 1, groups), label="controller-0")
        self.error: BaseException | None = None
        self.path, self.num_steps = path, num_steps
        self.thread = threading.Thread(target=self._body, name="yatt-single-controller", daemon=True)
        self.thread.start()

    def _body(self) -> None:
        try:
            start = self.core.prepare(self.path)
            self.core.run(start, self.num_steps)
        except BaseException as exc:  # handed to the watching thread
            self.error = exc
