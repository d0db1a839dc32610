"""Shared pieces of the policy losses: input checks, the clamped log ratio, ratio metrics, and the rollout
mismatch weighting every loss ends with. Kept apart so `policy_losses` and `policy_losses_extra` both build
on them without importing each other."""

from __future__ import annotations

from typing import Protocol

import torch

from yatt_algos.checks import as_bool_mask, check_same_shape
from yatt_algos.rollout_correction import rejection_mask, rollout_is_weights
from yatt_algos.types import AlgoConfig

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: finite in fp32, and far outside any clip range


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        config: AlgoConfig,
        *,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def prepare(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks shapes (all [B, T]); returns the bool mask [B, T] and the clamped log ratio log(pi / pi_old)
    [B, T], 0 where masked."""
    check_same_shape(
        "logprobs",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "response_mask": response_mask,
            "rollout_logprobs": rollout_logprobs,
        },
    )
    mask = as_bool_mask("response_mask", response_mask)
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return mask, log_ratio


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scalar metrics of the ratio pi / pi_old over the mask's tokens (log_ratio, mask [B, T])."""
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        ratio = log_ratio.detach().exp()
        # k3 of KL(pi_old || pi) on pi_old's samples: x = log(pi / pi_old) = log_ratio
        k3 = torch.expm1(log_ratio.detach()) - log_ratio.detach()
        big, small = torch.finfo(ratio.dtype).max, torch.finfo(ratio.dtype).min
        any_token = mask.any()
        return {
            "approx_kl": torch.where(mask, k3, 0.0).sum() / n,
            "ratio_mean": torch.where(mask, ratio, 0.0).sum() / n,
            "ratio_max": torch.where(mask, ratio, small).max() if any_token else ratio.new_tensor(1.0),
            "ratio_min": torch.where(mask, ratio, big).min() if any_token else ratio.new_tensor(1.0),
        }


def finish(
    loss: torch.Tensor,
    mask: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    config: AlgoConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Applies the mismatch weight and rejection when enabled, zeroes masked tokens, and adds their metrics.
    loss, mask, old/rollout logprobs [B, T] -> (loss [B, T], metrics: scalar tensors)."""
    if rollout_logprobs is not None and config.rollout_is_level != "none":
        weights, is_metrics = rollout_is_weights(
            old_logprobs,
            rollout_logprobs,
            mask,
            level=config.rollout_is_level,
            mode=config.rollout_is_mode,
            threshold=config.rollout_is_threshold,
            threshold_lower=config.rollout_is_threshold_lower,
            batch_normalize=config.rollout_is_batch_normalize,
        )
        loss = loss * weights.to(loss.dtype)
        metrics.update(is_metrics)
    if rollout_logprobs is not None and config.rollout_rs_level != "none":
        keep, rs_metrics = rejection_mask(
            old_logprobs,
            rollout_logprobs,
            mask,
            level=config.rollout_rs_level,
            threshold=config.rollout_rs_threshold,
            threshold_lower=config.rollout_rs_threshold_lower,
        )
        loss = torch.where(keep, loss, 0.0)
        metrics.update(rs_metrics)
    return torch.where(mask, loss, 0.0), metrics


def clip_frac(flag: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of the mask's tokens where the bool `flag` [B, T] is set: a scalar tensor."""
    return (flag & mask).sum() / mask.sum().clamp(min=1)
