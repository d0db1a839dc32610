"""KL divergence estimators between the policy and a reference, per token, after Schulman's "Approximating
KL Divergence" (2020): with x = log(ref / pi) at tokens sampled from pi,

- k1 = -x (unbiased, high variance, can be negative),
- k2 = x^2 / 2 (biased, low variance, >= 0),
- k3 = exp(x) - x - 1 (unbiased, low variance, >= 0).

k3 is clamped as verl and OpenRLHF do: the log ratio to [-20, 20] so exp never overflows, the estimate to
[0, 10] so one stray token cannot dominate a batch (a departure from the unbiased estimator, bounded).

Use as a loss term (`kl_penalty` then `aggregation.aggregate`), or as a reward penalty with a fixed or
adaptive coefficient (`apply_kl_penalty`, `adaptive_kl_coef`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_algos.checks import as_bool_mask, check_same_shape

_LOG_RATIO_CLAMP = 20.0
_K3_MAX = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log(pi / ref) per token. [B, T] -> [B, T]"""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(log(pi / ref))^2 / 2 per token. [B, T] -> [B, T]"""
    return 0.5 * (logprobs - ref_logprobs).square()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(x) - x - 1 with x = log(ref / pi), clamped to [0, 10]. [B, T] -> [B, T]"""
    x = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.expm1(x) - x).clamp(0.0, _K3_MAX)  # expm1 keeps small x accurate (no cancellation)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate [B, T] from logprobs [B, T] and ref_logprobs [B, T], by name."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator {estimator!r} is not one of {sorted(KL_ESTIMATORS)}")
    check_same_shape("logprobs", {"logprobs": logprobs, "ref_logprobs": ref_logprobs})
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty (InstructGPT, arXiv 2203.02155): r_t - coef * kl_t on response tokens.

    All [B, T]. Returns the penalized rewards [B, T] (zero where masked) and the batch's mean KL per token
    (a scalar, what `adaptive_kl_coef` tracks). k1 is the default here, as in PPO-RLHF practice.
    """
    check_same_shape(
        "token_rewards",
        {
            "token_rewards": token_rewards,
            "logprobs": logprobs,
            "ref_logprobs": ref_logprobs,
            "response_mask": response_mask,
        },
    )
    mask = as_bool_mask("response_mask", response_mask)
    kl = torch.where(mask, kl_penalty(logprobs, ref_logprobs, estimator), 0.0)
    rewards = torch.where(mask, token_rewards - coef * kl, 0.0)
    mean_kl = kl.sum() / mask.sum().clamp(min=1)
    return rewards, mean_kl


def adaptive_kl_coef(coef: float, current_kl: float, *, target: float, horizon: int, num_steps: int) -> float:
    """The adaptive KL controller of Ziegler et al. (arXiv 1909.08593): proportional control toward `target`.

    error = clip(current_kl / target - 1, -0.2, 0.2); coef <- coef * (1 + error * num_steps / horizon).
    num_steps is the number of samples (or steps) since the last update, as in the paper.
    """
    if target <= 0 or horizon < 1:
        raise ValueError(f"target must be > 0 and horizon >= 1, got {target}, {horizon}")
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_steps / horizon)
