"""CAPO (arXiv 2508.02298): token-level credit from an LLM's step critiques (`yatt capo`).

Every controller, on its own shard: generate n responses per prompt; the rule verifier gives r_v in {0, 1};
the judge model, as a GenPRM critic (yatt_multimodal.genprm), critiques each response K times in one pass
each (-> K wrong-step sets, and each step's token span through the policy's tokenizer); the sets are voted
(yatt_algos.capo, intersection by default); each response token gets R_t = r_v * W_whole -
1[t in a wrong step] * W_process; R is normalized over all tokens of all responses of the same prompt; then
the PPO-clip update and the versioned weight push.

The critic runs in the reward service: `CritiqueWorker` is the rule-reward worker plus the critic's engine.

Decision (the paper is silent): a response whose critiques all fail (unparseable, timeout, error) or that has
no steps gets no process penalty, only r_v * W_whole; such responses are counted (`capo/critique_failed_frac`),
never hidden.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from yatt_apps.config import CapoConfig, CapoSpec, tiny_cpu_capo
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime import policy_inputs
from yatt_apps.runtime.job import JobDef, StepFn, ValRows, build_services
from yatt_apps.runtime.phases import (
    kept_batch,
    old_logprobs,
    push_weights,
    rollout_and_score,
    sleep_engines,
    tokenizer,
    train_policy,
)
from yatt_apps.runtime.step_metrics import maybe_evaluate, sample_sums, summarize
from yatt_apps.runtime.workers import RewardWorker

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_controller.runner import Services
    from yatt_controller.worker_group import HostPool
    from yatt_placement.types import PlacementPlan


class CritiqueWorker(RewardWorker):
    """CAPO's reward service: `score` gives the rule terms (the verifier r_v); `critique` runs the GenPRM
    critic on the judge model's own engine in this process, mapping steps to tokens with the policy's
    tokenizer."""

    def __init__(
        self, cfg: CapoConfig, judge_dir: str, policy_dir: str, *, shared_device: bool = True
    ) -> None:
        from yatt_multimodal.genprm import GenPRM
        from yatt_multimodal.prompt_codecs import HFChatCodec

        from yatt_apps.io.models import load_tokenizer
        from yatt_apps.runtime.workers import build_engine

        super().__init__(cfg)  # the rule terms only: the judge model serves the critic
        spec = cfg.judge
        assert spec is not None, "capo's check requires a judge model"
        judge_tok = load_tokenizer(judge_dir, trust_remote_code=spec.trust_remote_code)
        engine = build_engine(
            cfg, spec, spec.engine, judge_dir, seed=cfg.run.seed + 1, shared_device=shared_device
        )
        self.engine = engine  # slept and woken like the GenRM's (RewardWorker.sleep / wake_up)
        self.critic = GenPRM(
            engine, HFChatCodec(judge_tok), cfg.capo.critic, tokenizer=load_tokenizer(policy_dir)
        )

    def critique(self, requests: list) -> list[dict[str, Any]]:
        """One `StepCritique` per request, as plain data."""
        import msgspec

        return [msgspec.to_builtins(c) for c in asyncio.run(self.critic.critique(requests))]

    def score_and_critique(self, requests: list) -> dict[str, Any]:
        """The rule terms (r_v) and the K step critiques of each request, in one call (one stream stage)."""
        return {**self.score(requests), "critiques": self.critique(requests)}


def capo_credit(
    verifier: Any,
    critiques: list,
    prompt_lens: list[int],
    response_mask: Any,
    group_ids: Any,
    spec: CapoSpec,
    *,
    eps: float,
) -> tuple[Any, Any, dict[str, float]]:
    """Token rewards R [B, T], advantages [B, T] and counts, for rows laid out as prompt then response.

    verifier [B] r_v in {0, 1}; critiques[b] row b's `StepCritique` (token spans relative to the response,
    shifted here by prompt_lens[b] into columns); response_mask [B, T]; group_ids [B] the prompt of each row.
    """
    import torch
    from yatt_algos.capo import capo_advantages, capo_token_rewards, vote_wrong_steps

    if not bool(((verifier == 0) | (verifier == 1)).all()):
        raise ValueError(
            f"CAPO needs a verifier reward of 0 or 1 per response, got {sorted(set(verifier.tolist()))[:5]}: "
            "use one rule term of weight 1 (e.g. math_verify)"
        )
    spans, votes, failed = [], [], 0
    for crit, offset in zip(critiques, prompt_lens, strict=True):
        spans.append([(offset + s, offset + e) for s, e in crit.token_spans])
        usable = crit.status == "ok" and len(crit.wrong_steps) > 0
        failed += not usable and len(crit.token_spans) > 0
        votes.append(
            vote_wrong_steps(crit.wrong_steps, spec.voting, num_steps=len(spans[-1])) if usable else {}
        )
    rewards = capo_token_rewards(
        verifier, spans, votes, response_mask, w_whole=spec.w_whole, w_process=spec.w_process
    )
    advantages = capo_advantages(rewards, response_mask, group_ids, eps=eps)
    whole = verifier.float()[:, None] * spec.w_whole
    penalized = (rewards < whole) & response_mask.bool()
    # the critic's agreement with the verifier: a critic flagging right and wrong answers alike adds noise,
    # not credit (issue 34's unlearning run had an untrained critic), so both rates are reported
    flagged = torch.tensor([len(v) > 0 for v in votes], dtype=torch.bool)
    right = verifier.detach().cpu() == 1
    counts = {
        "capo/critique_failed": float(failed),
        "capo/penalized_tokens": float(penalized.sum()),
        "capo/wrong_steps": float(sum(len(v) for v in votes)),
        "capo/right": float(right.sum()),
        "capo/flagged_right": float((flagged & right).sum()),
        "capo/flagged_wrong": float((flagged & ~right).sum()),
    }
    return rewards, advantages, counts


def capo_step(
    ctx: StepContext,
    rows: list[PromptRow],
    *,
    cfg: CapoConfig,
    policy_dir: str,
    val_rows: ValRows,
    plan: PlacementPlan,
) -> dict[str, float]:
    """One CAPO step on this controller's `rows`; returns metrics already reduced over controllers."""
    import msgspec
    import torch
    from yatt_multimodal.types import StepCritique

    tok = tokenizer(policy_dir)

    with ctx.phase("rollout_reward"):  # completions streamed into the verifier r_v and K step critiques each
        prompt_ids, scored = rollout_and_score(
            ctx, cfg, rows, tok, method="score_and_critique", token_ids=True
        )
        critiques = [msgspec.convert(d, StepCritique) for d in scored.extra["critiques"]]
    sums = maybe_evaluate(ctx, val_rows, cfg, tok)
    sleep_engines(ctx, cfg, plan)

    with ctx.phase("advantages"):  # vote, token rewards, normalize over each prompt's tokens
        kept, samples, batch = kept_batch(scored, prompt_ids, tok)
        group_ids = torch.tensor([scored.owner[i] for i in kept])
        verifier = torch.tensor([scored.scores[i] for i in kept], dtype=torch.float32)
        _, advantages, counts = capo_credit(
            verifier,
            [critiques[i] for i in kept],
            [len(prompt_ids[scored.owner[i]]) for i in kept],
            batch["response_mask"],
            group_ids,
            cfg.capo,
            eps=cfg.algo.adv_eps,
        )

    # old (this policy) and reference logprobs, on this controller's learner ranks
    with ctx.phase("logprobs"):
        lp, rollout_lp = old_logprobs(ctx, batch, samples)
        lp, policy_lp = policy_inputs.old_policy(cfg, lp, rollout_lp)  # bypass mode: the rollout's

    with ctx.phase("train"):  # PPO-clip, SPMD across controllers
        stats = train_policy(ctx, batch, lp, rollout_lp, advantages, group_ids=group_ids)

    push_weights(ctx, cfg, plan)

    sums |= sample_sums(scored, kept, len(rows), batch["response_mask"], lp, rollout_lp)
    sums |= policy_inputs.offpolicy_sums(cfg, policy_lp, rollout_lp, batch["response_mask"])
    sums |= counts
    total = ctx.all_reduce(sums)
    return summarize(total, stats, ctx.world_size) | capo_metrics(total)


def capo_metrics(total: dict[str, float]) -> dict[str, float]:
    """Means of the summed CAPO counts: per trained sample and per response token; the share of right (r_v = 1)
    and of wrong answers in which the vote flags a step (a useful critic: low, high; 0 where there are none)."""
    samples, tokens = max(total["samples"], 1.0), max(total["response_tokens"], 1.0)
    right, wrong = total["capo/right"], total["samples"] - total["capo/right"]
    return {
        "capo/critique_failed_frac": total["capo/critique_failed"] / samples,
        "capo/penalized_token_frac": total["capo/penalized_tokens"] / tokens,
        "capo/wrong_steps_mean": total["capo/wrong_steps"] / samples,
        "capo/flagged_right_frac": total["capo/flagged_right"] / right if right else 0.0,
        "capo/flagged_wrong_frac": total["capo/flagged_wrong"] / wrong if wrong else 0.0,
    }


def check(cfg: CapoConfig) -> None:
    if cfg.judge is None:
        raise ValueError("capo needs judge (the critic model): set judge.path or use --preset tiny_cpu_capo")
    if any(spec.kind == "genrm" for spec in cfg.rewards):
        raise ValueError("capo's rewards must be rule terms (the verifier r_v): remove the 'genrm' term")
    if cfg.algo.adv_estimator != "grpo":  # CAPO's token-level credit replaces the estimator
        raise ValueError(
            f"capo computes its own token advantages (yatt_algos.capo.capo_advantages, group-normalized as in "
            f"GRPO): algo.adv_estimator must be 'grpo', got {cfg.algo.adv_estimator!r}"
        )


def step_function(cfg: CapoConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    check(cfg)
    return functools.partial(capo_step, cfg=cfg, policy_dir=policy_dir, val_rows=val_rows, plan=plan)


def capo_services(
    pool: HostPool, *, cfg: CapoConfig, policy_dir: str, judge_dir: str, plan: PlacementPlan
) -> Services:
    """The default services with CAPO's reward service: the rule terms and the step critic on the judge."""
    return build_services(
        pool,
        cfg=cfg,
        policy_dir=policy_dir,
        judge_dir=judge_dir,
        plan=plan,
        reward_cls=CritiqueWorker,
        reward_args=(cfg, judge_dir, policy_dir),
    )


JOB = JobDef(
    name="capo",
    help="CAPO: token-level credit from K step critiques of a GenPRM judge, rule verifier, PPO-clip",
    preset=tiny_cpu_capo,
    step=step_function,
    config=CapoConfig,
    build=capo_services,
    check=check,
)
