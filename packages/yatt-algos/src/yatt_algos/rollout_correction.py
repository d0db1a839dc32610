"""Rollout/train mismatch correction by truncated importance sampling.

The rollout engine (vLLM, bf16 kernels) samples from pi_rollout, which differs slightly from the trainer's
pi_old computed on the same weights. Following Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025), the policy-gradient loss of each token is weighted by the detached
w = pi_old / pi_rollout, per token or per sequence (the product over the response), and large weights are
either truncated to the threshold C (TIS) or masked to zero (the sample is dropped: MIS).
"""

from __future__ import annotations

import torch

_LOG_CLAMP = 20.0


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    mode: str,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights [B, T] (1 where masked) and metrics, from old/rollout logprobs [B, T] and a
    bool mask [B, T]. level: "token" or "sequence"; mode: "truncate" (min(w, C)) or "mask" (w > C -> 0)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    with torch.no_grad():
        log_w = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).float()
        if level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)  # log of the product over the response
        w = log_w.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
        over = (w > threshold) & mask
        w = w.clamp(max=threshold) if mode == "truncate" else torch.where(over, 0.0, w)
        w = torch.where(mask, w, 1.0)
        n = mask.sum().clamp(min=1)
        # KL(rollout || old) by k3 on the rollout's own samples: x = log(old / rollout)
        x = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).float().clamp(-_LOG_CLAMP, _LOG_CLAMP)
        metrics = {
            "rollout_is_mean": torch.where(mask, w, 0.0).sum() / n,
            "rollout_is_over_frac": over.sum() / n,
            "rollout_mismatch_k3": torch.where(mask, torch.expm1(x) - x, 0.0).sum() / n,
        }
    return w, metrics
