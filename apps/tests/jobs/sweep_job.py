"""A job file of the tests' own (`yatt run apps/tests/jobs/sweep_job.py`): GRPO's step function, where step s
trains with the s-th (advantage estimator, policy loss) pair of yatt-algos' registries, so one run covers
every registered estimator and loss, each for one step, through the real job: Ray, the rollout engine, rule
rewards, the step's phases (the optimal token baselines' forward before the advantages, ReMax's greedy
baselines, GDPO's reward terms, bypass mode's rollout log-probs) and the gloo learner's update.

GAE needs the critic's values and runs in `yatt ppo` (its own test); every other estimator runs here.
The one thing that is not GRPO's: `SweepPolicyWorker.use_algo` swaps the learner's AlgoConfig between steps
(the optimizer state carries over), so that one start serves every pair.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from yatt_algos.advantages import ADVANTAGE_ESTIMATORS
from yatt_algos.policy_losses import POLICY_LOSSES
from yatt_apps.config import RewardSpec, RunConfig, tiny_cpu
from yatt_apps.jobs import grpo
from yatt_apps.runtime import producer
from yatt_apps.runtime.job import JobDef, build_services
from yatt_apps.runtime.workers import PolicyWorker

replace = msgspec.structs.replace
CRITIC_ESTIMATORS = ("gae",)  # yatt ppo's


def pairs() -> list[tuple[str, str]]:
    """(estimator, loss) per step: the longer registry in order, the shorter one cycling beside it."""
    estimators = sorted(set(ADVANTAGE_ESTIMATORS) - set(CRITIC_ESTIMATORS))
    losses = sorted(POLICY_LOSSES)
    n = max(len(estimators), len(losses))
    return [(estimators[i % len(estimators)], losses[i % len(losses)]) for i in range(n)]


def algo_of(cfg: RunConfig, step: int) -> Any:
    estimator, loss = pairs()[step]
    return replace(cfg.algo, adv_estimator=estimator, policy_loss=loss)


def sweep_cpu() -> RunConfig:
    """The warm-started tiny policy (its rewards vary within a group, so advantages are not all 0), rule
    rewards only, one controller on one device, 8 prompts x 4 samples of 8 tokens, token-level rollout IS, one step per
    pair."""
    base = tiny_cpu()
    rewards = [
        RewardSpec(kind="math_verify", weight=1.0),
        RewardSpec(kind="regex", name="format", weight=0.2, options={"pattern": r"^\s*-?\d+"}),
    ]
    return replace(
        base,
        app="sweep",
        judge=None,
        rewards=rewards,
        run=replace(base.run, num_steps=len(pairs()), prompts_per_step=8, eval_every=0),
        sampling=replace(base.sampling, n=4, max_new_tokens=8),
        # token-level rollout IS on: the optimal token baselines take its weights, every step logs diagnostics
        algo=replace(base.algo, num_updates_per_batch=1, rollout_is_level="token"),
        controller=replace(base.controller, num_controllers=1, checkpoint_every=0),
        # one device, one learner rank: what each pair shows is its own update (DDP is tested elsewhere)
        placement=replace(base.placement, cluster=replace(base.placement.cluster, devices_per_node=1)),
    )


class SweepPolicyWorker(PolicyWorker):
    def use_algo(self, algo: Any) -> None:
        self.learner.engine.algo = algo


def sweep_step(ctx: Any, rows: list, *, cfg: RunConfig, **kwargs: Any) -> dict[str, float]:
    algo = algo_of(cfg, ctx.step)
    ctx.get(ctx.services["actor"].broadcast("use_algo", algo))
    return grpo.grpo_step(ctx, rows, cfg=replace(cfg, algo=algo), **kwargs) | {"sweep/pair": float(ctx.step)}


def step_function(cfg: RunConfig, policy_dir: str, val_rows: Any, plan: Any) -> Any:
    return functools.partial(
        sweep_step,
        cfg=cfg,
        policy_dir=policy_dir,
        val_rows=val_rows,
        plan=plan,
        producers=producer.Producers(),
    )


def check(cfg: RunConfig) -> None:
    for step in range(cfg.run.num_steps):  # every pair's config is GRPO's to run
        grpo.check(replace(cfg, algo=algo_of(cfg, step)))


JOB = JobDef(
    name="sweep",
    help="every registered estimator and loss of yatt-algos for one step each (a test job)",
    preset=sweep_cpu,
    step=step_function,
    check=check,
    build=functools.partial(build_services, actor_cls=SweepPolicyWorker),
)
