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
from yatt_apps.runtime import agent_warmstart, policy_inputs, producer
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
    if cfg.rollout.env:  # multi-turn: the environment's tools are in every prompt (the template renders them)
        from yatt_apps.runtime.agent import prompt_tokenizer, validation_without_tools

        tok = prompt_tokenizer(tok, cfg)

    with ctx.phase("rollout_reward"):  # generation streamed into the reward service, chunk by chunk
        if cfg.algo.max_staleness:  # async: launch this step's batch, train on the oldest one in flight
            launched, scored = producers.of(ctx.rank).next_batch(ctx, cfg, rows, tok)
            rows, prompt_ids = launched.rows, launched.prompt_ids
        else:
            prompt_ids, scored = rollout_and_score(ctx, cfg, rows, tok)
        baselines = None
        if (
            cfg.algo.adv_estimator == "remax"
        ):  # ReMax: each prompt's greedy completion, scored, is its baseline
            baselines = policy_inputs.greedy_baselines(ctx, cfg, rows, prompt_ids, tok)
    sums = maybe_evaluate(ctx, val_rows, cfg, tok)  # the policy that generated this step's samples
    if cfg.rollout.env:  # the same policy's validation accuracy with the tools withheld
        sums |= validation_without_tools(ctx, val_rows, cfg, tok)
    sleep_engines(ctx, cfg, plan)  # full colocation: the engines give the devices to the learner

    with ctx.phase("advantages"):  # a prompt's group never leaves this controller
        kept, samples, batch = kept_batch(scored, prompt_ids, tok)
        routes = policy_inputs.routed_experts(cfg, batch, samples)  # an MoE policy: the rollout's experts
        if routes is not None:  # replayed with algo.routing_replay=r3; moe/routing_agreement in every mode
            batch["routed_experts"] = routes
        if cfg.rollout.env:  # multi-turn: the environment's tokens are not the policy's (mask 0)
            from yatt_apps.runtime.agent import mask_env_tokens

            mask_env_tokens(batch, [prompt_ids[scored.owner[i]] for i in kept], samples)
        group_ids = torch.tensor([scored.owner[i] for i in kept])
        score_t = torch.tensor([scored.scores[i] for i in kept], dtype=torch.float32)
        components = [scored.components[i] for i in kept]

    fused = old_logprobs_from_update(cfg)
    lp: dict = {}
    if policy_inputs.forward_before_advantages(cfg):  # the optimal token baselines read the old policy
        with ctx.phase("logprobs"):
            lp, rollout_lp = old_logprobs(ctx, batch, samples, sum_pi_squared=True)

    with ctx.phase("advantages"):
        mask = batch["response_mask"]
        baseline_t = None if baselines is None else torch.tensor([baselines[int(g)] for g in group_ids])
        inputs = policy_inputs.advantage_inputs(cfg, lp or None, rollout_lp if lp else None, mask, baseline_t)
        advantages = group_advantages(cfg, score_t, mask, group_ids, components, inputs)
        if cfg.algo.pf_ppo_method != "none":  # pf-PPO: train on rows resampled by reward
            picked = pf_ppo_rows(cfg, ctx, score_t)
            batch, advantages, group_ids = take_rows(batch, picked), advantages[picked], group_ids[picked]
            samples = [samples[i] for i in picked]
            if lp:
                lp, rollout_lp = take_rows(lp, picked), rollout_lp[picked]

    if fused:  # the update's own forward gives the old logprobs (in the train phase)
        rollout_lp = rollout_logprobs(batch, samples)
    elif not lp:  # old (this policy) and reference logprobs, on this controller's learner ranks
        with ctx.phase("logprobs"):  # bypass mode: the rollout's logprobs are the old ones (reference only)
            lp, rollout_lp = old_logprobs(ctx, batch, samples, policy=not policy_inputs.bypass(cfg))
    if (
        "routed_experts" in lp
    ):  # R2: the learner's own routing of the old-logprob pass, replayed in the update
        batch["routed_experts"] = lp.pop("routed_experts")
    lp, policy_lp = policy_inputs.old_policy(cfg, lp, rollout_lp)  # bypass mode: the rollout's

    version, train_started = ctx.policy_version, time.perf_counter()  # the policy being updated
    with ctx.phase("train"):  # SPMD: every learner rank updates together (gradient all-reduce)
        experience = {**batch, "advantages": advantages, "group_ids": group_ids}
        if fused:  # one call: the reference forward, then the update whose forward gives the old logprobs
            lp, stats = logprobs_and_train(ctx, {**experience, "rollout_logprobs": rollout_lp})
            policy_lp = lp["old_logprobs"]
        else:
            stats = train_policy(ctx, batch, lp, rollout_lp, advantages, group_ids=group_ids)

    push_weights(ctx, cfg, plan)  # version v+1 to every rollout replica; all controllers wait

    sums |= sample_sums(scored, kept, len(rows), batch["response_mask"], lp, rollout_lp)
    sums |= policy_inputs.offpolicy_sums(cfg, policy_lp, rollout_lp, batch["response_mask"])
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
        and not policy_inputs.forward_before_advantages(cfg)  # those ran the forward before the advantages
        and not policy_inputs.bypass(cfg)  # bypass mode: the old logprobs are the rollout's
    )


def rollout_logprobs(batch: dict, responses: list) -> Any:
    """The rollout engine's own logprobs of `responses` (one per row of `batch`) on the response tokens [B, T]
    (as `phases.old_logprobs` returns them beside the learner's)."""
    import torch

    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    flat: list[float] = []  # row after row, as a boolean index walks the mask: one assignment for the batch
    counts = batch["response_mask"].sum(1).tolist()
    for row, completion in enumerate(responses):
        logprobs = completion.logprobs
        if hasattr(completion, "response_mask"):  # a multi-turn trajectory: the model's tokens only
            logprobs = [v for v, m in zip(logprobs, completion.response_mask, strict=True) if m]
        if len(logprobs) != counts[row]:
            raise ValueError(
                f"rollout_logprobs: row {row} has {len(logprobs)} logprobs for {counts[row]} tokens"
            )
        flat.extend(logprobs)
    out[batch["response_mask"].bool()] = torch.tensor(flat, dtype=torch.float32)
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


def check(cfg: RunConfig) -> None:
    """The async settings (`producer.check_async`), and an estimator whose inputs the step provides: all but
    GAE (yatt ppo); ReMax's greedy baseline only on-policy (an async batch's policy is an older one)."""
    producer.check_async(cfg)
    policy_inputs.check_estimator(
        cfg,
        "grpo",
        ("optimal_token_baseline", "tir_optimal_token_baseline", "remax", "gdpo"),
        learner_backend(cfg),
    )
    if cfg.algo.adv_estimator == "remax" and cfg.algo.max_staleness:
        raise ValueError(
            "algo.adv_estimator='remax' greedy baselines need on-policy steps: set algo.max_staleness=0"
        )


JOB = JobDef(
    name="grpo",
    help="GRPO with rule rewards and a generative reward model (default: the tiny CPU run)",
    preset=tiny_cpu,
    step=step_function,
    check=check,
    prepare=agent_warmstart.prepare,  # rollout.env: the environment's rows, the multi-turn SFT warm start
    asynchronous=True,
)
