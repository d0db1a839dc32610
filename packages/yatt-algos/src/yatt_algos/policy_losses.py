"""Policy-gradient losses, per token. Each has the signature of `PolicyLossFn`:

    loss(logprobs, old_logprobs, advantages, response_mask, config, *, rollout_logprobs=None)
        -> (per-token loss [B, T], zero where masked; scalar metrics)

The loss is not aggregated: the caller reduces it with `aggregation.aggregate` under `config.loss_agg_mode`,
with global counts when it accumulates micro-batches. Metrics are detached scalars: clip_frac, approx_kl
(k3 of pi_old against pi, per token), ratio_mean, ratio_max, ratio_min, plus loss-specific ones.

When `rollout_logprobs` is given and `config.rollout_is_level` is not "none", every loss is multiplied by the
detached rollout/train mismatch weight of `rollout_correction.rollout_is_weights`; when `config.rollout_rs_level`
is not "none", rejected tokens (`rollout_correction.rejection_mask`) get weight 0.

Every function says where it departs from verl's `core_algos`; the package README collects them in one table.
"""

from __future__ import annotations

import torch

from yatt_algos.offpolicy import bypass_mode_loss
from yatt_algos.policy_loss_common import LOG_RATIO_CLAMP as _LOG_RATIO_CLAMP
from yatt_algos.policy_loss_common import PolicyLossFn
from yatt_algos.policy_loss_common import clip_frac as _clip_frac
from yatt_algos.policy_loss_common import finish as _finish
from yatt_algos.policy_loss_common import prepare as _prepare
from yatt_algos.policy_loss_common import ratio_metrics as _ratio_metrics
from yatt_algos.policy_losses_extra import clip_cov, dppo_kl, dppo_tv, dro, gmpo, gpg, kl_cov, reinforce, sapo
from yatt_algos.types import AlgoConfig


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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


def dual_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO (Ye et al., arXiv 1912.09729): for A < 0 the PPO-clip loss is also capped at
    -A * clip_ratio_c, so a huge ratio on a bad token cannot blow up the update. [B, T].
    clip_frac_lower is the share of tokens where that cap binds (their gradient is zero).
    verl's "vanilla" loss is this at clip_ratio_c = 3 (verl always applies the cap; `ppo_clip` never does)."""
    mask, _ = _prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, response_mask, config)
    cap = -advantages * config.clip_ratio_c  # > 0 where A < 0
    capped = (advantages < 0) & (loss.detach() > cap.detach())
    loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    metrics["clip_frac_lower"] = _clip_frac(capped, mask)
    return _finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., arXiv 2507.18071), in its GSPO-token form.

    s_i = exp(mean_t log(pi / pi_old)) over the response of sequence i; per token
    s_it = sg(s_i) * pi_it / sg(pi_it), whose value is s_i and whose gradient flows through each token;
    loss_it = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_clip_ratio_low, 1 + gspo_clip_ratio_high)). [B, T].
    With one advantage per sequence this is GSPO exactly; aggregate with "seq-mean-token-mean" for the
    paper's 1/G sum_i 1/|y_i| sum_t normalization. clip_frac counts clipped tokens (all tokens of a clipped
    sequence). Departures from verl's "gspo": verl clamps log s_it to at most 10 and always aggregates
    "seq-mean-token-mean"; here log s_it is clamped to [-20, 20] and `loss_agg_mode` decides.
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


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    "gmpo": gmpo,
    "gpg": gpg,
    "sapo": sapo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "reinforce": reinforce,
    "dro": dro,
    "bypass_mode": bypass_mode_loss,
}
