"""verl's rollout-correction helpers as plain functions: rejection criteria, the IS and off-policy
diagnostics, and bypass mode (rollout log-probs as the old policy) as one call.

Conventions: tensors [B, T] over the response; `log_ratio` = log(pi_train / pi_rollout) per token; masks are
bool or 0/1. The criteria follow verl's `rollout_corr_helper.compute_rollout_rejection_mask` (verl
commit b178a3c): per token k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio
(log_ratio clamped to [-20, 20]); "seq_sum_*", "seq_mean_*", "seq_max_*" reduce them over the response.
k1 options keep lower_log <= stat <= upper_log (threshold "lower_upper" as ratios, or one upper with lower
1 / upper); the others keep stat <= upper. Comma-chained criteria must all pass.
"""

from __future__ import annotations

import math

import torch

from yatt_algos.policy_loss_common import prepare
from yatt_algos.policy_losses_extra import reinforce
from yatt_algos.types import AlgoConfig

SAFETY_BOUND = 20.0
REJECTION_CRITERIA = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def _thresholds(options: list[str], spec: str | float) -> list[tuple[float | None, float]]:
    """(lower, upper) per option from verl's threshold spec: one entry shared, or one per option."""
    raw = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold {spec!r}: give one threshold or {len(options)} (one per criterion)"
        )
    raw = raw * len(options) if len(raw) == 1 else raw
    out: list[tuple[float | None, float]] = []
    for option, part in zip(options, raw, strict=True):
        if option.endswith("k1"):
            low_s, up_s = part.split("_", 1) if "_" in part else (None, part)
            upper = float(up_s)
            lower = float(low_s) if low_s is not None else 1.0 / upper
        elif "_" in part:
            raise ValueError(f"threshold {part!r} for {option!r}: only k1 criteria take 'lower_upper'")
        else:
            lower, upper = None, float(part)
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"thresholds for {option!r} must be positive, got {part!r}")
        out.append((lower, upper))
    return out


def rejection_criteria_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, criteria: str, thresholds: str | float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Keep mask [B, T] (bool, False at padding) after every comma-chained criterion, and metrics
    (`rollout_rs_<criterion>_masked_fraction`, `..._seq_masked_fraction`, and the combined ones).
    log_ratio, response_mask [B, T]. Criteria names and thresholds as verl's rollout_rs / rollout_rs_threshold."""
    options = list(dict.fromkeys(o.strip() for o in criteria.split(",") if o.strip()))
    bad = [o for o in options if o not in REJECTION_CRITERIA]
    if not options or bad:
        raise ValueError(
            f"unknown rejection criteria {bad or criteria!r}; known: {', '.join(REJECTION_CRITERIA)}"
        )
    mask = response_mask.bool()
    x = torch.where(mask, log_ratio.float(), 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.expm1(x) - x}
    count = mask.sum(-1)  # [B]
    rows = count > 0
    keep = mask.clone()
    metrics: dict[str, float] = {}
    for option, (lower, upper) in zip(options, _thresholds(options, thresholds), strict=True):
        stat = per_token[option[-2:]]
        if option.startswith("seq_sum"):
            stat = torch.where(mask, stat, 0.0).sum(-1, keepdim=True)
        elif option.startswith("seq_mean"):
            stat = torch.where(mask, stat, 0.0).sum(-1, keepdim=True) / count.clamp(min=1).unsqueeze(-1)
        elif option.startswith("seq_max"):
            top = torch.where(mask, stat, -torch.inf).amax(-1, keepdim=True)
            stat = torch.where(torch.isneginf(top), 0.0, top)
        # k1: both bounds, in log space; the others: an upper bound on the divergence
        ok = (stat >= math.log(lower)) & (stat <= math.log(upper)) if lower is not None else stat <= upper
        ok = ok.expand_as(mask)
        rejected = mask & ~ok
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(rejected.sum() / mask.sum().clamp(min=1))
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = float(
            (rejected.any(-1) & rows).sum() / rows.sum().clamp(min=1)
        )
        keep &= ok
    metrics["rollout_rs_masked_fraction"] = float((mask & ~keep).sum() / mask.sum().clamp(min=1))
    metrics["rollout_rs_seq_masked_fraction"] = float((mask & ~keep).any(-1).float().mean())
    return keep, metrics


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)
    return torch.where(mask, x, 0.0).sum(dim) / mask.sum(dim).clamp(min=1)


def compute_is_metrics(
    weights: torch.Tensor, log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, threshold: float
) -> dict[str, float]:
    """verl's IS diagnostics of (truncated) weights [B, T]: mean, std and effective sample size of the weights
    clamped to [1 / threshold, threshold], the shares above/below those bounds, max/min, and per-sequence
    stats of the row means (`rollout_is_seq_*`). log_ratio [B, T]: the unclamped log weight (at level
    "sequence", the sequence's summed log ratio on each of its tokens; padding is ignored here, where verl
    takes max/min/fractions over padding too)."""
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("response_mask must contain at least one valid token")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    w, lo = weights.float(), 1.0 / threshold
    m: dict[str, float] = {"rollout_is_mean": float(_masked_mean(w, mask))}
    if level == "sequence":
        lr = log_ratio.float()[mask]
        m["rollout_is_max"] = math.exp(min(float(lr.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(lr.min()))
        m["rollout_is_ratio_fraction_high"] = float((lr > math.log(threshold)).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((lr < math.log(lo)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(_masked_mean((w > threshold).float(), mask))
        m["rollout_is_ratio_fraction_low"] = float(_masked_mean((w < lo).float(), mask))
        m["rollout_is_max"] = float(w[mask].max())
        m["rollout_is_min"] = float(w[mask].min())
    clamped = w.clamp(min=lo, max=threshold)
    mean_c = _masked_mean(clamped, mask)
    var = _masked_mean(clamped.square(), mask) - mean_c.square()
    m["rollout_is_std"] = float(var.clamp(min=0).sqrt()) if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = float(1.0 / _masked_mean((clamped / (mean_c + 1e-8)).square(), mask))
    seq = _masked_mean(w, mask, dim=-1)  # [B]: each row's mean weight (verl: padded rows count as 0)
    m["rollout_is_seq_mean"] = float(seq.mean())
    m["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = float(seq.max())
    m["rollout_is_seq_min"] = float(seq.min())
    m["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    m["rollout_is_seq_fraction_high"] = float((seq > threshold).float().mean())
    m["rollout_is_seq_fraction_low"] = float((seq < lo).float().mean())
    return m


def compute_offpolicy_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's off-policy diagnostics from training (old) and rollout log-probs [B, T]: perplexities (batch
    mean of per-sequence exp(-mean log p)), KL(rollout || train) directly and by k3, log-PPL differences,
    the PPL ratio, and chi^2 at token (E[rho^2] - 1) and sequence (E[(prod rho)^2] - 1) level."""
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("response_mask must contain at least one valid token")
    old = old_logprobs.float()
    mean_train = _masked_mean(old, mask, dim=-1)  # [B]
    m = {
        "training_ppl": float(torch.exp(-mean_train).mean()),
        "training_log_ppl": float((-mean_train).mean()),
    }
    if rollout_logprobs is None:
        return m
    roll = rollout_logprobs.float()
    log_ratio = torch.where(mask, old - roll, 0.0)
    mean_roll = _masked_mean(roll, mask, dim=-1)
    diff = mean_roll - mean_train  # [B] log(train ppl / rollout ppl)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m |= {
        "kl": float(_masked_mean(roll - old, mask)),
        "k3_kl": float(_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "rollout_ppl": float(torch.exp(-mean_roll).mean()),
        "rollout_log_ppl": float((-mean_roll).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(_masked_mean(safe.exp().square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * log_ratio.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0),
    }
    return m


def bypass_mode(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | float]]:
    """verl's "bypass_mode" policy loss in one call: the rollout log-probs are the old policy (no old-logprob
    forward). Returns (per-token loss [B, T], the effective mask [B, T] after rejection, metrics); the caller
    aggregates the loss over the returned mask, as verl aggregates over its modified response mask.

    Weights w = pi / pi_rollout (detached; per token, or the sequence's product at rollout_is "sequence"),
    truncated at rollout_is_threshold. loss_type "reinforce": -A log pi * w on kept tokens (w = 1 without
    rollout_is); "ppo_clip": PPO's clipped surrogate with ratio pi / pi_rollout and no extra weight (the clip
    already bounds the IS ratio; weighting again would count it twice). rollout_rs: comma-chained criteria
    of `rejection_criteria_mask` on log(pi / pi_rollout), applied to either loss type. The metrics include
    `compute_offpolicy_metrics` of the current policy against the rollout's, under `rollout_corr/` (verl
    computes them in its bypass loss too: no separate old-policy forward runs). All inputs [B, T]."""
    from yatt_algos.policy_losses import ppo_clip  # here: policy_losses registers this module's loss

    if loss_type not in ("reinforce", "ppo_clip"):
        raise ValueError(f"bypass_mode loss_type must be 'reinforce' or 'ppo_clip', got {loss_type!r}")
    mask = response_mask.bool()
    metrics: dict[str, torch.Tensor | float] = {}
    with torch.no_grad():
        if mask.any():  # verl's diagnostics of the training (current) policy against the rollout's
            diagnostics = compute_offpolicy_metrics(logprobs.detach(), rollout_logprobs, mask)
            metrics |= {f"rollout_corr/{key}": value for key, value in diagnostics.items()}
        log_ratio = torch.where(mask, logprobs.detach() - rollout_logprobs, 0.0).float()
        if rollout_rs is not None:
            if rollout_rs_threshold is None:
                raise ValueError("bypass_mode: rollout_rs needs rollout_rs_threshold")
            keep, rs_metrics = rejection_criteria_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold)
            metrics |= rs_metrics
            mask = mask & keep
        weights = None
        if rollout_is is not None:
            if rollout_is not in ("token", "sequence"):
                raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {rollout_is!r}")
            log_w = (
                log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
                if rollout_is == "sequence"
                else log_ratio
            )
            weights = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().clamp(max=rollout_is_threshold)
            if mask.any():
                metrics |= compute_is_metrics(weights, log_w, mask, rollout_is, rollout_is_threshold)
    if loss_type == "reinforce":
        loss, loss_metrics = reinforce(logprobs, rollout_logprobs, advantages, mask, config)
        if weights is not None:
            loss = loss * weights.to(loss.dtype)
    else:
        loss, loss_metrics = ppo_clip(logprobs, rollout_logprobs, advantages, mask, config)
    metrics |= loss_metrics
    return torch.where(mask, loss, 0.0), mask, metrics


def bypass_mode_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registry form of `bypass_mode` (POLICY_LOSSES["bypass_mode"]): `old_logprobs` are the rollout's
    log-probs (the job passes them as the old policy); loss type, IS level and criteria come from
    `config.bypass_loss_type`, `rollout_is_level` / `rollout_is_threshold`, `bypass_rs_criteria` /
    `bypass_rs_threshold`. Rejected tokens get loss 0 and still count in the aggregation's normalizer
    (the learner plans normalizers before the loss; verl drops them from its mask). [B, T]."""
    prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)  # the registry's checks
    level = None if config.rollout_is_level == "none" else config.rollout_is_level
    loss, _, metrics = bypass_mode(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        config,
        loss_type=config.bypass_loss_type,
        rollout_is=level,
        rollout_is_threshold=config.rollout_is_threshold,
        rollout_rs=config.bypass_rs_criteria or None,
        rollout_rs_threshold=config.bypass_rs_threshold or None,
    )
    return loss, {k: torch.as_tensor(v) for k, v in metrics.items()}
