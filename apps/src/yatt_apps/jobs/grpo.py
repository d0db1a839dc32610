"""GRPO with rule rewards and a generative reward model: the flagship job.

`grpo_step` is the whole RL step, run by every controller on its own shard of prompts (parallel mode) or by
one driver-side controller on all of them (single mode): n completions per prompt streamed into scoring (rule
terms and K GenRM judgements per completion, judging a chunk while later chunks still generate), old and
reference logprobs, group-normalised advantages, the SPMD update across controllers, and the versioned weight
push. It reads top to bottom; the phases it calls live in `yatt_apps.runtime.phases`.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from yatt_apps.config import RunConfig, tiny_cpu
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime import producer
from yatt_apps.runtime.job import JobDef, StepFn, ValRows
from yatt_apps.runtime.phases import (
    concat_rows,
    group_advantages,
    kept_batch,
    learner_of,
    old_logprobs,
    pf_ppo_rows,
    push_weights,
    rollout_and_score,
    sleep_engines,
    take_rows,
    tokenizer,
    train_policy,
)
from yatt_apps.runtime.step_metrics import judge_sums, maybe_evaluate, sample_sums, summarize
from yatt_apps.runtime.workers import learner_backend

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_placement.types import PlacementPlan


def grpo_step(
    ctx: StepContext,
    rows: list[PromptRow],
    *,
    cfg: RunConfig,
    policy_dir: str,
    val_rows: ValRows,
    plan: PlacementPlan,
    producers: producer.Producers,
) -> dict[str, float]:
    """One GRPO step on this controller's `rows`; returns metrics already reduced over controllers.
    `producers`: the async producer of each controller (`algo.max_staleness > 0`), held with this step."""
    import torch

    tok = tokenizer(policy_dir)

    with ctx.phase("rollout_reward"):  # generation streamed into the reward service, chunk by chunk
        if cfg.algo.max_staleness:  # async: launch this step's batch, train on the oldest one in flight
            launched, scored = producers.of(ctx.rank).next_batch(ctx, cfg, rows, tok)
            rows, prompt_ids = launched.rows, launched.prompt_ids
        else:
            prompt_ids, scored = rollout_and_score(ctx, cfg, rows, tok)
    sums = maybe_evaluate(ctx, val_rows, cfg, tok)  # the policy that generated this step's samples
    sleep_engines(ctx, cfg, plan)  # full colocation: the engines give the devices to the learner

    with ctx.phase("advantages"):  # a prompt's group never leaves this controller
        kept, samples, batch = kept_batch(scored, prompt_ids, tok)
        if cfg.rollout.env:  # multi-turn: the environment's tokens are not the policy's (mask 0)
            from yatt_apps.runtime.agent import mask_env_tokens

            mask_env_tokens(batch, [prompt_ids[scored.owner[i]] for i in kept], samples)
        group_ids = torch.tensor([scored.owner[i] for i in kept])
        score_t = torch.tensor([scored.scores[i] for i in kept], dtype=torch.float32)
        components = [scored.components[i] for i in kept]
        advantages = group_advantages(cfg, score_t, batch["response_mask"], group_ids, components)
        if cfg.algo.pf_ppo_method != "none":  # pf-PPO: train on rows resampled by reward
            picked = pf_ppo_rows(cfg, ctx, score_t)
            batch, advantages, group_ids = take_rows(batch, picked), advantages[picked], group_ids[picked]
            samples = [samples[i] for i in picked]

    fused = old_logprobs_from_update(cfg)
    if not fused:  # old (this policy) and reference logprobs, on this controller's learner ranks
        with ctx.phase("logprobs"):
            lp, rollout_lp = old_logprobs(ctx, batch, samples)

    version, train_started = ctx.policy_version, time.perf_counter()  # the policy being updated
    with ctx.phase("train"):  # SPMD: every learner rank updates together (gradient all-reduce)
        experience = {**batch, "advantages": advantages, "group_ids": group_ids}
        if fused:  # one call: the reference forward, then the update whose forward gives the old logprobs
            rollout_lp = rollout_logprobs(batch, samples)
            lp, stats = logprobs_and_train(ctx, {**experience, "rollout_logprobs": rollout_lp})
        else:
            stats = train_policy(ctx, batch, lp, rollout_lp, advantages, group_ids=group_ids)

    push_weights(ctx, cfg, plan)  # version v+1 to every rollout replica; all controllers wait

    sums |= sample_sums(scored, kept, len(rows), batch["response_mask"], lp, rollout_lp)
    sums |= judge_sums(cfg, scored, kept)
    if cfg.algo.max_staleness:
        own = producers.of(ctx.rank)
        sums |= own.async_sums(ctx, scored, kept, version, (train_started, time.perf_counter()))
        own.store_queue(ctx, cfg)  # a checkpoint after this step holds the batches in flight
    if cfg.rollout.env:  # turns, tool calls, tool errors by kind, truncated episodes
        from yatt_apps.runtime.agent import agent_sums

        sums |= agent_sums(scored.completions)
    return summarize(ctx.all_reduce(sums), stats, ctx.world_size)


def old_logprobs_from_update(cfg: RunConfig) -> bool:
    """Whether the step skips the separate old-logprob forward: with one optimizer step per batch (one update,
    one mini-batch) on a torch learner, the policy is unchanged until that step, so the training forward's
    detached logprobs are the old ones, bit for bit (TRL skips it likewise)."""
    return (
        cfg.algo.num_updates_per_batch == 1
        and cfg.optim.mini_batch_size == 0
        and learner_backend(cfg) != "megatron"
    )


def rollout_logprobs(batch: dict, responses: list) -> Any:
    """The rollout engine's own logprobs of `responses` (one per row of `batch`) on the response tokens [B, T]
    (as `phases.old_logprobs` returns them beside the learner's)."""
    import torch

    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for row, completion in enumerate(responses):
        logprobs = completion.logprobs
        if hasattr(completion, "response_mask"):  # a multi-turn trajectory: the model's tokens only
            logprobs = [v for v, m in zip(logprobs, completion.response_mask, strict=True) if m]
        out[row, batch["response_mask"][row]] = torch.tensor(logprobs)
    return out


def logprobs_and_train(ctx: StepContext, experience: dict) -> tuple[dict, dict[str, float]]:
    """Reference logprobs and the update in one SPMD call on this controller's learner ranks
    (`PolicyWorker.logprobs_and_train`): returns `old_logprobs`'s tensors [B, T] joined in row order, and the
    update's global stats (rank 0's stand for all)."""
    parts = ctx.get(learner_of(ctx).shard_rows("logprobs_and_train", experience))
    stats = [part.pop("stats") for part in parts]  # every part's, so that only tensors are joined
    return concat_rows(parts), stats[0]


def step_function(cfg: RunConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    return functools.partial(
        grpo_step,
        cfg=cfg,
        policy_dir=policy_dir,
        val_rows=val_rows,
        plan=plan,
        producers=producer.Producers(),
    )


JOB = JobDef(
    name="grpo",
    help="GRPO with rule rewards and a generative reward model (default: the tiny CPU run)",
    preset=tiny_cpu,
    step=step_function,
    check=producer.check_async,
    asynchronous=True,
)
