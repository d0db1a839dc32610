"""What a job is, in one object: `JobDef(name, help, preset, step, roles, build, check, ...)`.

A job module (`jobs/grpo.py`, ..., or a user's own file run with `yatt run FILE.py`) ends with
`JOB = JobDef(...)`; the registry in `yatt_apps.jobs` lists the shipped ones, and the `yatt` command, `yatt config`
and `yatt plan` read it: adding a job edits no other file. Most jobs take the defaults here: the policy
(actor) and its rollout engine, and a reward service that is a GenRM judge when the config has a judge model.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from yatt_apps.config import ModelSpec, RunConfig
from yatt_apps.io.data import PromptRow

if (
    TYPE_CHECKING
):  # for annotations only: yatt_controller and yatt_placement load nothing heavy, but stay lazy
    from pathlib import Path

    from yatt_controller.controller import StepContext
    from yatt_controller.runner import Services
    from yatt_controller.worker_group import HostPool
    from yatt_placement.types import PlacementPlan, RoleSpec

__all__ = ["JobDef", "StepFn", "ValRows", "build_services", "policy_roles"]

# the validation rows of the run (read on first call, in the controller that evaluates), or None
ValRows = Callable[[], list[PromptRow]] | None
# what every controller runs once per step on its batch: (ctx, rows) -> the step's metrics
StepFn = Callable[["StepContext", list[PromptRow]], dict[str, float]]
# builds the step function of a run: (cfg, policy_dir, val_rows, plan) -> StepFn, where cfg is an instance of
# the job's `config` class (hence `...`: a job's factory may take its own subclass of RunConfig)
StepFactory = Callable[..., StepFn]


def num_params(spec: ModelSpec) -> float:
    """For planning: the spec's count, else the transformer estimate 12 L h^2 + 2 V h."""
    return (
        spec.num_params or 12 * spec.num_layers * spec.hidden_size**2 + 2 * spec.vocab_size * spec.hidden_size
    )


def policy_roles(cfg: RunConfig, *, critic: bool = False) -> list[RoleSpec]:
    """The trained policy (actor), its rollout engine, an optional critic beside the actor, and the reward
    service (`genrm` with a judge model, else a light `reward` role). In disaggregated mode the trainer gets
    one replica per controller (parallel) and `placement.rollout_replicas` sizes the rollout. An actor replica
    spans `model.tensor_parallel x model.pipeline_parallel` devices (Megatron's stages); a rollout replica
    only `tensor_parallel` (the engine holds the whole model)."""
    from yatt_placement.types import RoleSpec

    policy, tp, pp = num_params(cfg.model), cfg.model.tensor_parallel, cfg.model.pipeline_parallel
    place = cfg.placement
    trainer = cfg.controller.num_controllers if place.mode == "disaggregated" else 0
    rollout = place.rollout_replicas if place.mode != "colocated" else 0
    roles = [
        RoleSpec(
            role="actor",
            num_params=policy,
            trainable=True,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            num_replicas=trainer,
        ),
        RoleSpec(role="rollout", num_params=policy, tensor_parallel=tp, num_replicas=rollout),
    ]
    if critic:  # the value model: the policy's backbone with a one-label head, trained beside it
        roles.append(
            RoleSpec(
                role="critic", num_params=policy, trainable=True, tensor_parallel=tp, num_replicas=trainer
            )
        )
    if cfg.judge is not None:
        roles.append(
            RoleSpec(
                role="genrm", num_params=num_params(cfg.judge), tensor_parallel=cfg.judge.tensor_parallel
            )
        )
    else:
        # rule terms only: no model, so no device of its own (it runs beside each rollout engine)
        roles.append(RoleSpec(role="reward", num_params=1e6, shares="rollout"))
    return roles


def reward_role(cfg: RunConfig) -> str:
    """The reward service's role: `genrm` when a judge model serves it, else the light rule-only `reward`."""
    return "genrm" if cfg.judge is not None else "reward"


def reward_lock(cfg: RunConfig, reward_cls: Any) -> str:
    """The host lock group of the reward's calls. Rule terms only (`RewardWorker` without a judge) hold no
    engine, so they get a group of their own ("rules"): scoring one chunk never waits for a generate call of
    the engine beside it on that device. A judge, or another reward class (which may hold a model), shares
    the engines' group ("host"): two models in one process never run at once."""
    from yatt_apps.runtime.workers import RewardWorker

    return "rules" if reward_cls is RewardWorker and reward_role(cfg) == "reward" else "host"


def build_services(
    pool: HostPool,
    *,
    cfg: RunConfig,
    policy_dir: str,
    judge_dir: str,
    plan: PlacementPlan,
    reward_cls: Any = None,
    reward_args: tuple = (),
    extra: Callable[[HostPool, dict[str, Any]], Any] | None = None,
    rollout_cls: Any = None,
    actor_cls: Any = None,
) -> Services:
    """The default services: `actor` (the learner, with its reference), `rollout` (the policy's engine, fed
    by weight pushes: in process where it shares a learner rank's process, broadcast elsewhere) and `reward`
    (`reward_cls`, default the rule/GenRM `RewardWorker`). `extra(pool, groups)` adds a job's own groups and
    returns the names of those every checkpoint holds. `rollout_cls` replaces the rollout worker class (a
    RolloutWorker subclass; default RolloutWorker, or AgentRolloutWorker with `rollout.env`); `actor_cls` the
    learner's (a PolicyWorker subclass; default PolicyWorker). Each engine
    learns from `plan` whether the learner shares its devices (vLLM then takes a part of the memory). Groups
    on devices of their own start at the same time (a learner loads while an engine starts); a group whose
    devices hold an earlier one waits for it, so one host process never builds two roles at once."""
    from yatt_controller.runner import Services
    from yatt_controller.sync import WeightSync
    from yatt_controller.worker_group import WorkerGroup

    from yatt_apps.runtime.workers import PolicyWorker, RewardWorker, RolloutWorker

    key = f"yatt-actor-{uuid.uuid4().hex}"  # this attempt's learner rendezvous (a restart gets a new one)
    starting: dict[str, WorkerGroup] = {}

    def after_sharers(role: str) -> None:  # the groups on `role`'s devices exist before it is created there
        for other, group in starting.items():
            if plan.shares_device(role, other):
                group.ready()

    actor = starting["actor"] = WorkerGroup.create(
        pool,
        "actor",
        actor_cls or PolicyWorker,
        args=(cfg, policy_dir, key),
        pass_worker_info=True,
        lock="learner",
        wait=False,
    )
    if rollout_cls is None:
        rollout_cls = RolloutWorker
    if cfg.rollout.env and rollout_cls is RolloutWorker:  # multi-turn episodes of a registered environment
        from yatt_apps.runtime.agent import AgentRolloutWorker

        rollout_cls = AgentRolloutWorker
    after_sharers("rollout")
    rollout = starting["rollout"] = WorkerGroup.create(
        pool,
        "rollout",
        rollout_cls,
        args=(cfg, policy_dir),
        kwargs={"shared_device": plan.shares_device("rollout", "actor")},
        pass_worker_info=True,
        wait=False,
    )
    cls = reward_cls or RewardWorker
    after_sharers(reward_role(cfg))
    reward = WorkerGroup.create(
        pool,
        reward_role(cfg),
        cls,
        args=reward_args or (cfg, judge_dir),
        kwargs={"shared_device": plan.shares_device(reward_role(cfg), "actor")},
        pass_worker_info=cls is RewardWorker,
        lock=reward_lock(cfg, cls),
        wait=False,
    )
    for group in (actor, rollout, reward):
        group.ready()
    groups = {"actor": actor, "rollout": rollout, "reward": reward}
    stateful = tuple(extra(pool, groups)) if extra is not None else ()
    sync = WeightSync(actor, [rollout], mode="auto", backend="auto")  # NCCL where the workers have CUDA
    return Services(groups=groups, learner="actor", weight_sync=sync, checkpointed=stateful)


@dataclass(frozen=True)
class JobDef:
    """A job in one object. `name` is its command (`yatt NAME`, and `app` in its config); `help` its one line
    in `yatt --help`; `preset` its default config (a function of no arguments, also listed under `--preset`);
    `config` its config class (RunConfig, or a subclass with the job's own keys: `yatt config` shows these);
    `step(cfg, policy_dir, val_rows, plan)` returns the step function every controller runs; `roles(cfg)` what
    the planner places; `build(pool, cfg=, policy_dir=, judge_dir=, plan=)` the services; `check(cfg)` raises
    ValueError for a config the job cannot run; `prepare(cfg, run_dir)` returns the config the run uses (e.g.
    with an embedded dataset written into the run directory); `asynchronous`: the step trains with a
    bounded-staleness producer when `algo.max_staleness > 0` (others refuse it); `dataset(cfg)` the job's own
    training rows (None: the prompt datasets); `export(run, cfg)` the final folder once the run is done (None:
    the policy learner's last checkpoint as an HF folder, `launch.export_final`)."""

    name: str
    help: str
    preset: Callable[[], RunConfig]
    step: StepFactory
    config: type[RunConfig] = RunConfig
    # each takes the job's config (an instance of `config`) first, hence `...`
    roles: Callable[..., list[RoleSpec]] = policy_roles
    build: Callable[..., Services] = build_services
    check: Callable[..., None] | None = None
    prepare: Callable[..., RunConfig] | None = None
    asynchronous: bool = False
    dataset: Callable[..., Any] | None = None
    export: Callable[..., Path | None] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(
                f"JobDef.name must be a command name (letters, digits, - and _), got {self.name!r}"
            )
