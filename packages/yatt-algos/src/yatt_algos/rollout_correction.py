"""Rollout/train mismatch correction: importance weights and rejection sampling.

The rollout engine (vLLM, bf16 kernels) samples from pi_rollout, which differs slightly from the trainer's
pi_old computed on the same weights. Following Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025), the policy-gradient loss of each token is weighted by the detached
w = pi_old / pi_rollout, per token or per sequence (the product over the response), and large weights are
either truncated to the threshold C (TIS) or masked to zero (the sample is dropped: MIS). IcePop (Ling team,
arXiv 2510.18855) also masks weights below a lower bound. The weights can be normalized to mean 1.

Rejection sampling (`rejection_mask`) drops tokens, or whole sequences, whose ratio leaves
[lower, upper], whatever the weights; it is verl's `rollout_rs` "token_k1" (token) and "seq_sum_k1"
(sequence). Departure from verl: the losses apply it as a zero weight, so rejected tokens still count in the
aggregation's normalizer (the learner plans the normalizers before the loss); for verl's exact behaviour
multiply the batch's response_mask by `rejection_mask(...)` before the update.
"""

from __future__ import annotations

import torch

_LOG_CLAMP = 20.0


def _log_weights(old_logprobs, rollout_logprobs, mask, level):
    """log(pi_old / pi_rollout) per token, or its sum over the response on every token. [B, T], float32."""
    log_w = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).float()
    if level == "sequence":
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)  # log of the product over the response
    return log_w


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    mode: str,
    threshold: float,
    threshold_lower: float = 0.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights [B, T] (1 where masked) and metrics, from old/rollout logprobs [B, T] and a
    bool mask [B, T]. level: "token" or "sequence"; mode: "truncate" (min(w, C)) or "mask" (w > C -> 0, and
    w < threshold_lower -> 0 when it is > 0: IcePop). batch_normalize divides the weights by their mean over
    this call's tokens (token level) or sequences (sequence level), as verl's rollout_is_batch_normalize; a
    learner calls this per micro-batch, so the mean is the micro-batch's, where verl takes the whole batch's.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    if threshold_lower > 0 and mode != "mask":
        raise ValueError(f"threshold_lower > 0 (IcePop) needs mode 'mask', got {mode!r}")
    with torch.no_grad():
        w = _log_weights(old_logprobs, rollout_logprobs, mask, level).clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
        over = (w > threshold) & mask
        under = (w < threshold_lower) & mask
        w = w.clamp(max=threshold) if mode == "truncate" else torch.where(over | under, 0.0, w)
        w = torch.where(mask, w, 1.0)
        n = mask.sum().clamp(min=1)
        # KL(rollout || old) by k3 on the rollout's own samples: x = log(old / rollout)
        x = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).float().clamp(-_LOG_CLAMP, _LOG_CLAMP)
        metrics = {
            "rollout_is_mean": torch.where(mask, w, 0.0).sum() / n,
            "rollout_is_over_frac": over.sum() / n,
            "rollout_mismatch_k3": torch.where(mask, torch.expm1(x) - x, 0.0).sum() / n,
        }
        if threshold_lower > 0:
            metrics["rollout_is_under_frac"] = under.sum() / n
        if batch_normalize:
            w = _normalize(w, mask, level)
    return w, metrics


def _normalize(w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """w / mean(w): over unmasked tokens, or over sequences with a token (one weight each). [B, T]."""
    if level == "token":
        mean = torch.where(mask, w, 0.0).sum() / mask.sum().clamp(min=1)
    else:
        rows = mask.any(dim=-1)
        per_seq = torch.where(mask, w, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # [B], the row's weight
        mean = per_seq.sum() / rows.sum().clamp(min=1)
    if mean <= 1e-8:  # every weight masked: leave them (verl does the same)
        return w
    return torch.where(mask, w / mean, 1.0)


def rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    threshold: float,
    threshold_lower: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep mask [B, T] (bool; True where masked out by `mask` too, so it can multiply a loss) and metrics.

    A token (level "token") or a whole sequence (level "sequence", ratio = the product over its response) is
    rejected when w = pi_old / pi_rollout is outside [threshold_lower, threshold]; threshold_lower 0 means
    1 / threshold, verl's default for a single-number threshold. Inputs [B, T], bool mask [B, T].
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    lower = threshold_lower if threshold_lower > 0 else 1.0 / threshold
    if not 0 < lower < threshold:
        raise ValueError(f"threshold_lower must be in (0, threshold), got {lower} and {threshold}")
    with torch.no_grad():
        log_w = _log_weights(old_logprobs, rollout_logprobs, mask, level)
        # compare in log space: a sequence's product can under- or overflow
        reject = (
            (log_w > torch.log(torch.tensor(threshold))) | (log_w < torch.log(torch.tensor(lower)))
        ) & mask
        rows = mask.any(dim=-1)
        metrics = {
            "rollout_rs_masked_frac": reject.sum() / mask.sum().clamp(min=1),
            "rollout_rs_seq_masked_frac": (reject.any(-1) & rows).sum() / rows.sum().clamp(min=1),
        }
    return ~reject, metrics
