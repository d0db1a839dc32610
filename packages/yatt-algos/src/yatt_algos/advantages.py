"""Advantage estimators. Every estimator has one signature, so the registry can drive any of them:

    estimator(rewards, response_mask, config, *, group_ids=None, values=None, baseline_rewards=None)
        -> (advantages [B, T], returns [B, T]), both zero where response_mask is 0

`rewards` is either one score per sequence [B] (placed on the last response token where a per-token reward
is needed) or per-token rewards [B, T] (e.g. with a KL penalty from `kl.apply_kl_penalty`; summed over the
response where a score is needed). `group_ids` [B] (any integers, groups in any order) names each sample's
prompt. Masks may have holes (tool output inside a response): masked tokens are skipped, never credited.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_algos.checks import as_bool_mask, check_2d, check_no_empty_rows, check_rows
from yatt_algos.groups import group_mean_std
from yatt_algos.types import AlgoConfig


def _mask_and_check(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    check_2d("response_mask", response_mask)
    if rewards.dim() == 1:
        check_rows("rewards", rewards, response_mask.shape[0])
    elif tuple(rewards.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"rewards must be [B] or [B, T] like response_mask {tuple(response_mask.shape)}, "
            f"got {tuple(rewards.shape)}"
        )
    if response_mask.shape[0] == 0:
        raise ValueError("response_mask is empty: the batch has no sequences")
    mask = as_bool_mask("response_mask", response_mask)
    check_no_empty_rows("response_mask", mask)
    return mask


def _scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scores: the rewards themselves, or per-token rewards summed over the response."""
    return rewards if rewards.dim() == 1 else torch.where(mask, rewards, 0.0).sum(dim=-1)


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] rewards: a [B] score goes on each row's last response token."""
    if rewards.dim() == 2:
        return torch.where(mask, rewards, 0.0)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=-1).values  # [B]
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    return out.scatter_(1, last.unsqueeze(-1), rewards.unsqueeze(-1))


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, per_seq.unsqueeze(-1), 0.0)


def _require(name: str, tensor: torch.Tensor | None, estimator: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{estimator} needs {name}")
    return tensor


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over the unmasked tokens of each row (masked ones are skipped). [B, T]."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, 0.0)
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over all unmasked entries of the batch; zero where masked. [B, T]."""
    n = mask.sum().clamp(min=1)
    mean = torch.where(mask, values, 0.0).sum() / n
    var = torch.where(mask, (values - mean).square(), 0.0).sum() / (n - 1).clamp(min=1)
    return torch.where(mask, (values - mean) / (var.sqrt() + eps), 0.0)


def gae(rewards, response_mask, config: AlgoConfig, *, group_ids=None, values=None, baseline_rewards=None):
    """Generalized advantage estimation (Schulman et al., arXiv 1506.02438) with config.gamma, config.lam.

    delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next, where "next" is the next unmasked
    token (0 after the last); returns = A + V. values [B, T] is the critic's estimate on the same tokens.
    Advantages are not whitened here (use `masked_whiten` for PPO's batch normalization).
    """
    mask = _mask_and_check(rewards, response_mask)
    values = _require("values", values, "gae")
    if tuple(values.shape) != tuple(mask.shape):
        raise ValueError(f"values has shape {tuple(values.shape)}, expected {tuple(mask.shape)}")
    r = _token_rewards(rewards, mask).to(values.dtype)
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in range(mask.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + config.gamma * next_value - values[:, t]
        adv_t = delta + config.gamma * config.lam * next_adv
        adv[:, t] = torch.where(m, adv_t, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    return adv, torch.where(mask, adv + values, 0.0)


def grpo(rewards, response_mask, config: AlgoConfig, *, group_ids=None, values=None, baseline_rewards=None):
    """GRPO (Shao et al., arXiv 2402.03300): A_i = (s_i - mean_g) / (std_g + adv_eps) on every token.

    std is the unbiased group std (as verl and TRL). config.norm_by_std=False gives Dr.GRPO
    (arXiv 2503.20783): A_i = s_i - mean_g. Departure: a group of one sample gets A = 0 (no comparison is
    possible), where verl uses the raw score. A zero-variance group gets 0, never NaN. returns = score.
    """
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    mean, std, size = group_mean_std(scores, _require("group_ids", group_ids, "grpo"))
    adv = scores - mean
    if config.norm_by_std:
        adv = adv / (std + config.adv_eps)
    adv = torch.where(size > 1, adv, 0.0)
    return _broadcast(adv, mask), _broadcast(scores, mask)


def rloo(rewards, response_mask, config: AlgoConfig, *, group_ids=None, values=None, baseline_rewards=None):
    """RLOO (Ahmadian et al., arXiv 2402.14740): A_i = s_i - mean_{j != i} s_j = n / (n - 1) (s_i - mean_g).

    A group of one sample gets A = 0. returns = score.
    """
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    mean, _, size = group_mean_std(scores, _require("group_ids", group_ids, "rloo"))
    adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), 0.0)
    return _broadcast(adv, mask), _broadcast(scores, mask)


def reinforce_pp(
    rewards, response_mask, config: AlgoConfig, *, group_ids=None, values=None, baseline_rewards=None
):
    """REINFORCE++ (Hu, arXiv 2501.03262): discounted returns of the per-token rewards (the score plus any
    per-token KL penalty), whitened over all response tokens of the batch. returns = the raw returns."""
    mask = _mask_and_check(rewards, response_mask)
    returns = discounted_returns(_token_rewards(rewards, mask), mask, config.gamma)
    return masked_whiten(returns, mask, config.adv_eps), returns


def reinforce_pp_baseline(
    rewards, response_mask, config: AlgoConfig, *, group_ids=None, values=None, baseline_rewards=None
):
    """REINFORCE++-baseline (arXiv 2501.03262 v2): the group mean score is subtracted (on the last token),
    then discounted returns are whitened over the batch, as in REINFORCE++."""
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    mean, _, _ = group_mean_std(scores, _require("group_ids", group_ids, "reinforce_pp_baseline"))
    token_rewards = _token_rewards(rewards, mask) - _token_rewards(mean, mask)
    returns = discounted_returns(token_rewards, mask, config.gamma)
    return masked_whiten(returns, mask, config.adv_eps), returns


def remax(rewards, response_mask, config: AlgoConfig, *, group_ids=None, values=None, baseline_rewards=None):
    """ReMax (Li et al., arXiv 2310.10505): A_t = G_t - b, b the reward of the greedy response to the same
    prompt (baseline_rewards [B]); G_t the discounted return (gamma = 1: the score on every token)."""
    mask = _mask_and_check(rewards, response_mask)
    baseline = _require("baseline_rewards", baseline_rewards, "remax")
    check_rows("baseline_rewards", baseline, mask.shape[0])
    returns = discounted_returns(_token_rewards(rewards, mask), mask, config.gamma)
    return torch.where(mask, returns - baseline.unsqueeze(-1), 0.0), returns


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "remax": remax,
}


def compute_advantages(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    **kwargs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to `ADVANTAGE_ESTIMATORS[config.adv_estimator]`."""
    return ADVANTAGE_ESTIMATORS[config.adv_estimator](rewards, response_mask, config, **kwargs)
