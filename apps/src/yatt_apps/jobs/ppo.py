"""PPO with a learned critic (Schulman et al., arXiv 1707.06347; the RLHF recipe of Ouyang et al., arXiv
2203.02155), run by every controller on its own shard: generate, score with the rule rewards, old and
reference logprobs and the critic's values, the KL to the reference as a per-token reward penalty, GAE
advantages (arXiv 1506.02438) whitened over the whole batch (all controllers), then the clipped policy update
and the clipped value update, both SPMD across controllers, and the versioned weight push.

The critic is `CriticWorker`: an HF token-classification model with one label, built from the policy's
directory (same backbone weights, a fresh value head), trained by yatt_algos' `TorchCriticLearner`, hosted
beside the policy learner rank on each device (the "critic" role of the placement plan).

Departures: the KL coefficient is fixed (`algo.kl_reward_coef`; the adaptive controller of Ziegler et al. is
not wired here); n completions per prompt are sampled as in the tiny GRPO run, each its own PPO sample.
"""

from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING, Any

from yatt_apps.config import PpoConfig, tiny_cpu_ppo
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime import policy_inputs
from yatt_apps.runtime.job import JobDef, StepFn, ValRows, build_services, policy_roles
from yatt_apps.runtime.phases import (
    kept_batch,
    old_logprobs,
    push_weights,
    rollout_and_score,
    sleep_engines,
    tokenizer,
    train,
    train_policy,
)
from yatt_apps.runtime.step_metrics import maybe_evaluate, sample_sums, summarize

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_controller.runner import Services
    from yatt_controller.worker_group import HostPool
    from yatt_placement.types import PlacementPlan


class CriticWorker:
    """One data-parallel rank of the critic. Colocated with the policy learner rank, it shares that host
    process's torch.distributed group (calls on one host run one at a time, in the same order on every rank,
    so the two learners' collectives never interleave); alone on its device it opens its own under `key`."""

    def __init__(self, cfg: PpoConfig, model_dir: str, key: str, *, worker_info: Any) -> None:
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForTokenClassification
        from yatt_algos.learner.torch_backend import TorchCriticLearner

        from yatt_apps.runtime.workers import join_learner_group, set_threads

        set_threads(cfg)
        torch.manual_seed(cfg.run.seed + 1)  # the value head's init; identical on every rank
        group = None
        if worker_info.dp_size > 1:
            if not dist.is_initialized():
                join_learner_group(worker_info, key)
            if dist.get_world_size() != worker_info.dp_size:
                raise ValueError(
                    f"the critic has {worker_info.dp_size} data-parallel ranks but its host's process group has "
                    f"{dist.get_world_size()}: colocate the critic with the actor, one rank per actor rank"
                )
            group = dist.group.WORLD
        model = AutoModelForTokenClassification.from_pretrained(
            model_dir,
            num_labels=1,
            dtype=torch.float32,
            local_files_only=True,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.learner = TorchCriticLearner(
            model, algo=cfg.algo, optim_config=cfg.critic_optim or cfg.optim, learner=cfg.learner, group=group
        )

    def values(self, batch: dict[str, Any]) -> Any:
        """V(s_t) [B, T], aligned like logprobs (0 at position 0 and padding)."""
        return self.learner.compute_values(batch)

    def train(self, experience: dict[str, Any]) -> dict[str, float]:
        stats = self.learner.update(experience)
        return {"loss": stats.loss, "grad_norm": stats.grad_norm, **stats.metrics}

    def checkpoint_state(self) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save(self.learner.state_dict(), buf)
        return buf.getvalue()

    def load_checkpoint_state(self, data: bytes) -> None:
        import torch

        self.learner.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))


def whiten_across(ctx: StepContext, advantages: Any, mask: Any) -> Any:
    """PPO's advantage normalization over every response token of every controller's batch. [B, T]."""
    import torch

    local = torch.where(mask, advantages, 0.0).double()
    sums = ctx.all_reduce(
        {"n": float(mask.sum()), "s": float(local.sum()), "ss": float(local.square().sum())}
    )
    n = max(sums["n"], 1.0)
    mean = sums["s"] / n
    var = max(sums["ss"] / n - mean * mean, 0.0) * n / max(n - 1.0, 1.0)  # unbiased, as masked_whiten
    return torch.where(mask, (advantages - mean) / (var**0.5 + 1e-8), 0.0).float()


def kl_coef(ctx: StepContext, cfg: PpoConfig) -> float:
    """The KL-in-reward coefficient of this step: `algo.kl_reward_coef`, or with `algo.kl_target > 0` the
    adaptive controller's value, which this controller's `ctx.state` carries across steps and checkpoints."""
    return float(ctx.state.get("kl_coef", cfg.algo.kl_reward_coef))


def update_kl_coef(ctx: StepContext, cfg: PpoConfig, current_kl: float, batch_size: float) -> None:
    """PPO's adaptive KL controller (Ziegler et al. 2019, verl's `AdaptiveKLController`): one update from the
    step's global token-mean KL over `batch_size` sequences (verl's n_steps); every controller computes the
    same value from the all-reduced figures."""
    if not cfg.algo.kl_target:
        return
    from yatt_algos.kl import AdaptiveKLController

    controller = AdaptiveKLController(kl_coef(ctx, cfg), cfg.algo.kl_target, cfg.algo.kl_horizon)
    controller.update(current_kl, int(batch_size))
    ctx.state["kl_coef"] = controller.value


def ppo_step(
    ctx: StepContext,
    rows: list[PromptRow],
    *,
    cfg: PpoConfig,
    policy_dir: str,
    val_rows: ValRows,
    plan: PlacementPlan,
) -> dict[str, float]:
    """One PPO step on this controller's `rows`; returns metrics already reduced over controllers."""
    import torch
    from yatt_algos.advantages import ADVANTAGE_ESTIMATORS
    from yatt_algos.kl import apply_kl_penalty

    tok = tokenizer(policy_dir)
    critic = ctx.services["critic"]

    with ctx.phase("rollout_reward"):  # generation streamed into the rule rewards
        prompt_ids, scored = rollout_and_score(ctx, cfg, rows, tok)
        kept, samples, batch = kept_batch(scored, prompt_ids, tok)
        mask = batch["response_mask"]
    sums = maybe_evaluate(ctx, val_rows, cfg, tok)
    sleep_engines(ctx, cfg, plan)

    with ctx.phase("logprobs"):  # policy and reference on the learner ranks, values on the critic beside them
        values_refs = critic.shard_rows("values", batch)
        lp, rollout_lp = old_logprobs(ctx, batch, samples)
        lp, policy_lp = policy_inputs.old_policy(cfg, lp, rollout_lp)  # bypass mode: the rollout's
        values = torch.cat(ctx.get(values_refs))

    with ctx.phase("advantages"):  # score on the last token, minus coef * KL on every token; GAE
        scores = torch.tensor([scored.scores[i] for i in kept], dtype=torch.float32)
        token_rewards = torch.zeros(mask.shape)
        last = mask.long().cumsum(-1).argmax(-1)  # [B] position of each row's last response token
        token_rewards[torch.arange(len(kept)), last] = scores
        reference = lp.get("ref_logprobs", lp["old_logprobs"])
        token_rewards, mean_kl = apply_kl_penalty(
            token_rewards,
            lp["old_logprobs"],
            reference,
            mask,
            coef=kl_coef(ctx, cfg),
            estimator=cfg.algo.kl_estimator,
        )
        advantages, returns = ADVANTAGE_ESTIMATORS[cfg.algo.adv_estimator](
            token_rewards, mask, cfg.algo, values=values
        )
        advantages = whiten_across(ctx, advantages, mask)

    with ctx.phase("train"):  # the policy, then the critic, each SPMD across controllers
        stats = train_policy(ctx, batch, lp, rollout_lp, advantages)
        critic_stats = train(ctx, {**batch, "returns": returns, "old_values": values}, group="critic")

    push_weights(ctx, cfg, plan)

    sums |= sample_sums(scored, kept, len(rows), mask, lp, rollout_lp)
    sums |= policy_inputs.offpolicy_sums(cfg, policy_lp, rollout_lp, mask)
    sums["ppo/kl_reward/sum"] = float(mean_kl) * float(mask.sum())  # KL per token x tokens
    total = ctx.all_reduce(sums)
    out = summarize({k: v for k, v in total.items() if not k.startswith("ppo/")}, stats, ctx.world_size)
    tokens = max(total["response_tokens"], 1.0)
    # the critic's stats are global (reduced in its learner): vf_loss, value_mean, return_mean, explained var
    out.update({f"critic/{k}": v for k, v in critic_stats.items()})
    out["ppo/kl_reward"] = total["ppo/kl_reward/sum"] / tokens
    out["ppo/kl_coef"] = kl_coef(ctx, cfg)  # the coefficient this step's rewards used
    update_kl_coef(ctx, cfg, out["ppo/kl_reward"], total["samples"])  # the next step's (adaptive)
    return out


def step_function(cfg: PpoConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    return functools.partial(ppo_step, cfg=cfg, policy_dir=policy_dir, val_rows=val_rows, plan=plan)


def ppo_services(
    pool: HostPool, *, cfg: PpoConfig, policy_dir: str, judge_dir: str, plan: PlacementPlan
) -> Services:
    """The default services plus the critic beside the actor; its weights and optimizer are checkpointed."""
    import uuid

    from yatt_controller.worker_group import WorkerGroup

    def critic(pool, groups) -> tuple[str, ...]:
        key = f"yatt-critic-{uuid.uuid4().hex}"
        args = (cfg, policy_dir, key)
        groups["critic"] = WorkerGroup.create(
            pool, "critic", CriticWorker, args=args, pass_worker_info=True, lock="learner"
        )
        return ("critic",)

    return build_services(pool, cfg=cfg, policy_dir=policy_dir, judge_dir=judge_dir, plan=plan, extra=critic)


def check(cfg: PpoConfig) -> None:
    """PPO's advantages are GAE's, on the critic's values and the KL-penalized token rewards; the outcome
    estimators (group baselines) run in yatt grpo."""
    if cfg.algo.adv_estimator != "gae":
        raise ValueError(
            f"yatt ppo trains with GAE on the critic's values: algo.adv_estimator must be 'gae', got "
            f"{cfg.algo.adv_estimator!r} (the outcome estimators run in yatt grpo)"
        )


JOB = JobDef(
    name="ppo",
    help="PPO with a critic (GAE, KL as a reward penalty, clipped value loss) on rule rewards",
    preset=tiny_cpu_ppo,
    step=step_function,
    config=PpoConfig,
    roles=functools.partial(policy_roles, critic=True),
    build=ppo_services,
    check=check,
)
