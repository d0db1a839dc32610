"""Policy-gradient losses, per token. Each has the signature of `PolicyLossFn`:

    loss(logprobs, old_logprobs, advantages, response_mask, config, *, rollout_logprobs=None)
        -> (per-token loss [B, T], zero where masked; scalar metrics)

The loss is not aggregated: the caller reduces it with `aggregation.aggregate` under `config.loss_agg_mode`,
with global counts when it accumulates micro-batches. Metrics are detached scalars: clip_frac, approx_kl
(k3 of pi_old against pi, per token), ratio_mean, ratio_max, ratio_min, plus loss-specific ones.

When `rollout_logprobs` is given and `config.rollout_is_level` is not "none", every loss is multiplied by the
detached rollout/train mismatch weight of `rollout_correction.rollout_is_weights`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from yatt_algos.checks import as_bool_mask, check_same_shape
from yatt_algos.rollout_correction import rollout_is_weights
from yatt_algos.types import AlgoConfig

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: finite in fp32, and far outside any clip range


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


def _prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs):
    """Checks shapes; returns the bool mask and the clamped log ratio log(pi / pi_old), 0 where masked."""
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
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return mask, log_ratio


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
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


def _finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config):
    """Applies the mismatch weight when enabled, zeroes masked tokens, and adds the weight's metrics."""
    if rollout_logprobs is not None and config.rollout_is_level != "none":
        weights, is_metrics = rollout_is_weights(
            old_logprobs,
            rollout_logprobs,
            mask,
            level=config.rollout_is_level,
            mode=config.rollout_is_mode,
            threshold=config.rollout_is_threshold,
        )
        loss = loss * weights.to(loss.dtype)
        metrics.update(is_metrics)
    return torch.where(mask, loss, 0.0), metrics


def _clip_frac(flag: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (flag & mask).sum() / mask.sum().clamp(min=1)


def ppo_clip(logprobs, old_logprobs, advantages, response_mask, config, *, rollout_logprobs=None):
    """PPO's clipped surrogate (arXiv 1707.06347) with DAPO's asymmetric clip-higher (arXiv 2503.14476).

    r = pi / pi_old; loss = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)). All [B, T].
    Where the clipped term wins, the token's gradient is zero. clip_frac is the share of such tokens.
    """
    mask, log_ratio = _prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    ratio = log_ratio.exp()
    loss_plain = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss = torch.maximum(loss_plain, loss_clipped)
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = _clip_frac(loss_clipped.detach() > loss_plain.detach(), mask)
    return _finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def dual_clip(logprobs, old_logprobs, advantages, response_mask, config, *, rollout_logprobs=None):
    """Dual-clip PPO (Ye et al., arXiv 1912.09729): for A < 0 the PPO-clip loss is also capped at
    -A * clip_ratio_c, so a huge ratio on a bad token cannot blow up the update. [B, T].
    clip_frac_lower is the share of tokens where that cap binds (their gradient is zero)."""
    mask, _ = _prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, response_mask, config)
    cap = -advantages * config.clip_ratio_c  # > 0 where A < 0
    capped = (advantages < 0) & (loss.detach() > cap.detach())
    loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    metrics["clip_frac_lower"] = _clip_frac(capped, mask)
    return _finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def gspo(logprobs, old_logprobs, advantages, response_mask, config, *, rollout_logprobs=None):
    """GSPO (Zheng et al., arXiv 2507.18071), in its GSPO-token form.

    s_i = exp(mean_t log(pi / pi_old)) over the response of sequence i; per token
    s_it = sg(s_i) * pi_it / sg(pi_it), whose value is s_i and whose gradient flows through each token;
    loss_it = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_clip_ratio_low, 1 + gspo_clip_ratio_high)). [B, T].
    With one advantage per sequence this is GSPO exactly; aggregate with "seq-mean-token-mean" for the
    paper's 1/G sum_i 1/|y_i| sum_t normalization. clip_frac counts clipped tokens (all tokens of a clipped
    sequence).
    """
    mask, log_ratio = _prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / lengths  # [B, 1]
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()  # value s_i, gradient per token
    ratio = torch.where(mask, token_log_ratio, 0.0).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    loss_plain = -advantages * ratio
    clipped = ratio.clamp(1.0 - config.gspo_clip_ratio_low, 1.0 + config.gspo_clip_ratio_high)
    loss_clipped = -advantages * clipped
    loss = torch.maximum(loss_plain, loss_clipped)
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["seq_ratio_mean"] = torch.where(
        mask.any(-1), seq_log_ratio.squeeze(-1).detach().exp(), 0.0
    ).sum() / (mask.any(-1).sum().clamp(min=1))
    metrics["clip_frac"] = _clip_frac(loss_clipped.detach() > loss_plain.detach(), mask)
    return _finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def cispo(logprobs, old_logprobs, advantages, response_mask, config, *, rollout_logprobs=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): loss = -sg(clip(r, 1 - low, 1 + high)) * A * log pi. [B, T].

    Clipping the detached IS weight, not the update, keeps every token's gradient (A * w * grad log pi).
    low = cispo_clip_ratio_low (1.0: no lower bound, as in the paper), high = cispo_clip_ratio_high.
    clip_frac is the share of tokens whose weight was clipped.
    """
    mask, log_ratio = _prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    ratio = log_ratio.detach().exp()
    lo, hi = max(0.0, 1.0 - config.cispo_clip_ratio_low), 1.0 + config.cispo_clip_ratio_high
    weight = ratio.clamp(lo, hi)
    loss = -weight * advantages * torch.where(mask, logprobs, 0.0)
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = _clip_frac((ratio < lo) | (ratio > hi), mask)
    return _finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip,
    "dual_clip": dual_clip,
    "gspo": gspo,
    "cispo": cispo,
}
