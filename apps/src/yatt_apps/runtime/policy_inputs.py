"""What an advantage estimator or a policy loss needs from the step beyond the rewards, and the off-policy
diagnostics a rollout correction logs.

- The optimal token baselines (`optimal_token_baseline`, `tir_optimal_token_baseline`) weigh each token by
  the old policy's own probabilities: the step runs the old-logprob forward (with the sum of squared
  probabilities) before its advantages, and passes the rollout IS weights when a correction is on.
- ReMax needs a baseline reward per prompt: one greedy completion of each prompt, scored like the samples.
- `bypass_mode` (verl) takes the rollout engine's log-probs as the old policy: the step's old log-probs are
  the rollout's, and the policy forward runs only where something else needs it.
- Whenever a correction is on (rollout IS or rejection, or bypass mode) the step logs verl's off-policy
  diagnostics (`compute_offpolicy_metrics`, and `compute_is_metrics` with IS weights) under `rollout_corr/`.

A job that cannot provide an input refuses the config at start (`check_estimator`), naming the input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from yatt_apps.config import RunConfig

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext

    from yatt_apps.io.data import PromptRow

OPTIMAL_TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")
# what each estimator needs that only some jobs provide (the error names it)
NEEDS = {
    "optimal_token_baseline": "old_logprobs and sum_pi_squared before the advantages (a policy forward)",
    "tir_optimal_token_baseline": "old_logprobs and sum_pi_squared before the advantages (a policy forward)",
    "remax": "baseline_rewards (a greedy completion of each prompt, scored)",
    "gdpo": "reward_components (each reward term's own score per sample)",
    "gae": "values (a critic: use yatt ppo)",
}


def check_estimator(cfg: RunConfig, job: str, provides: tuple[str, ...], backend: str) -> None:
    """Refuse at start an `algo.adv_estimator` whose inputs the job `job` does not provide (`provides`: the
    estimators of NEEDS it does); the optimal token baselines also need the torch learner's forward with the
    sum of squared probabilities (not in the Megatron learner)."""
    estimator = cfg.algo.adv_estimator
    if estimator in NEEDS and estimator not in provides:
        raise ValueError(
            f"algo.adv_estimator={estimator!r} needs {NEEDS[estimator]}, which yatt {job} does not provide "
            f"(it provides those of: {', '.join(provides) or 'none'})"
        )
    if estimator in OPTIMAL_TOKEN_BASELINES and backend == "megatron":
        raise ValueError(
            f"algo.adv_estimator={estimator!r} needs sum_pi_squared from the learner's forward, which the "
            "Megatron learner does not compute: set learner.backend to ddp or fsdp2"
        )


def forward_before_advantages(cfg: RunConfig) -> bool:
    """Whether the estimator reads the old policy's log-probs (and sum of squared probabilities)."""
    return cfg.algo.adv_estimator in OPTIMAL_TOKEN_BASELINES


def bypass(cfg: RunConfig) -> bool:
    """verl's bypass mode: the rollout's log-probs are the old policy's."""
    return cfg.algo.policy_loss == "bypass_mode"


def old_policy(cfg: RunConfig, lp: dict[str, Any], rollout_lp: Any) -> tuple[dict[str, Any], Any]:
    """(the logprobs the update takes as the old policy's, the training policy's own logprobs or None): in
    bypass mode the old logprobs are the rollout's; the policy's own, where a forward gave them, stay for the
    off-policy diagnostics."""
    policy_lp = lp.get("old_logprobs")
    if bypass(cfg):
        return {**lp, "old_logprobs": rollout_lp}, policy_lp
    return lp, policy_lp


def correction_on(cfg: RunConfig) -> bool:
    """A rollout/train mismatch correction is on: IS weights, rejection, or bypass mode."""
    algo = cfg.algo
    return algo.rollout_is_level != "none" or algo.rollout_rs_level != "none" or bypass(cfg)


def is_weights(cfg: RunConfig, old: Any, rollout: Any, mask: Any) -> Any:
    """The truncated (or masked) rollout IS weights [B, T] of `algo.rollout_is_*`, or None when IS is off."""
    from yatt_algos.rollout_correction import rollout_is_weights

    algo = cfg.algo
    if algo.rollout_is_level == "none":
        return None
    weights, _ = rollout_is_weights(
        old,
        rollout,
        mask.bool(),
        level=algo.rollout_is_level,
        mode=algo.rollout_is_mode,
        threshold=algo.rollout_is_threshold,
        threshold_lower=algo.rollout_is_threshold_lower,
        batch_normalize=algo.rollout_is_batch_normalize,
    )
    return weights


def advantage_inputs(
    cfg: RunConfig, lp: dict[str, Any] | None, rollout_lp: Any, mask: Any, baselines: Any = None
) -> dict[str, Any]:
    """The keyword inputs of `ADVANTAGE_ESTIMATORS[estimator]` beyond scores, mask and groups: the optimal
    token baselines' old_logprobs, sum_pi_squared and rollout IS weights (from `lp`, the old-logprob
    forward), ReMax's baseline_rewards [B] (`baselines`)."""
    out: dict[str, Any] = {}
    if forward_before_advantages(cfg):
        assert (
            lp is not None and "sum_pi_squared" in lp
        )  # the step ran the forward (forward_before_advantages)
        out["old_logprobs"] = lp["old_logprobs"]
        out["sum_pi_squared"] = lp["sum_pi_squared"]
        out["rollout_is_weights"] = is_weights(cfg, lp["old_logprobs"], rollout_lp, mask)
    if cfg.algo.adv_estimator == "remax":
        out["baseline_rewards"] = baselines
    return out


def greedy_baselines(
    ctx: StepContext, cfg: RunConfig, rows: list[PromptRow], prompt_ids: list[list[int]], tok: Any
) -> list[float]:
    """ReMax's baseline (arXiv 2310.10505): the reward of one greedy completion of each prompt, scored by the
    same reward service as the samples (prompt order)."""
    import msgspec

    from yatt_apps.runtime.phases import chunks_per_replica, generate_and_score

    greedy = msgspec.structs.replace(cfg.sampling, n=1, temperature=0.0)
    tag = f"s{ctx.step}-c{ctx.rank}-greedy"
    scored = generate_and_score(
        ctx, rows, prompt_ids, greedy, tag, None, tok, per_replica=chunks_per_replica(cfg)
    )
    baseline = [0.0] * len(rows)
    for owner, score in zip(scored.owner, scored.scores, strict=True):
        baseline[owner] = score
    return baseline


def offpolicy_sums(cfg: RunConfig, policy_lp: Any, rollout_lp: Any, mask: Any) -> dict[str, float]:
    """verl's off-policy diagnostics of this controller's batch, each times its number of rows (the step
    all-reduces sums; `offpolicy_means` divides by the rows of every controller): perplexities, KL(rollout ||
    train), chi^2, and the IS weights' statistics when IS is on. Empty when no correction is on, or when the
    step ran no policy forward: in bypass mode the loss reports the same diagnostics from its own forward
    (`yatt_algos.offpolicy.bypass_mode`)."""
    from yatt_algos.offpolicy import compute_is_metrics, compute_offpolicy_metrics

    if not correction_on(cfg) or policy_lp is None or not bool(mask.any()):
        return {}
    rows = float(mask.shape[0])
    metrics = compute_offpolicy_metrics(policy_lp, rollout_lp, mask)
    algo = cfg.algo
    if algo.rollout_is_level != "none":
        import torch

        log_ratio = torch.where(mask.bool(), policy_lp - rollout_lp, 0.0)
        if algo.rollout_is_level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        weights = is_weights(cfg, policy_lp, rollout_lp, mask)
        metrics |= compute_is_metrics(
            weights, log_ratio, mask, algo.rollout_is_level, algo.rollout_is_threshold
        )
    out = {f"rollout_corr/{key}/sum": value * rows for key, value in metrics.items()}
    out["rollout_corr/rows"] = rows
    return out


def offpolicy_means(total: dict[str, float]) -> dict[str, float]:
    """The `rollout_corr/*` figures of all controllers: each controller's value weighted by its rows (a max or
    min is then the row-weighted mean of the controllers' maxima or minima)."""
    rows = total.get("rollout_corr/rows", 0.0)
    if not rows:
        return {}
    return {
        key.removesuffix("/sum"): value / rows
        for key, value in total.items()
        if key.startswith("rollout_corr/") and key.endswith("/sum")
    }


def routed_experts(cfg: RunConfig, batch: dict[str, Any], samples: list) -> Any:
    """The rollout's expert choices of a mixture-of-experts policy as the learner batch's `routed_experts`
    [B, T, layers, k] (int16, -1 where none; row b's prompt and response positions but the last), or None when
    no sample carries them (a dense policy, an engine that does not record them) or replay is "r2" (the
    learner's own old-logprob pass gives them). With `algo.routing_replay` "off" the learner only measures
    `moe/routing_agreement` against them; with "r3" it replays them."""
    from yatt_algos.learner.routing import routes_to_batch
    from yatt_rollout.routing import decode_routes

    if cfg.algo.routing_replay == "r2":
        return None
    routes = [getattr(s, "routed_experts", None) for s in samples]
    first = next((r for r in routes if r is not None), None)
    if first is None:
        return None
    rows = [None if r is None else decode_routes(r) for r in routes]
    return routes_to_batch(rows, batch["input_ids"].shape[1], first.num_layers, first.top_k)
