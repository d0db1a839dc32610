"""Advantage estimators. Every estimator has one signature, so the registry can drive any of them:

    estimator(rewards, response_mask, config, *, group_ids=None, values=None, baseline_rewards=None,
              reward_components=None, old_logprobs=None, sum_pi_squared=None)
        -> (advantages [B, T], returns [B, T]), both zero where response_mask is 0

Each estimator uses the inputs it needs and ignores the others: group_ids [B] (group estimators),
values [B, T] (GAE), baseline_rewards [B] (ReMax), reward_components [B, K] (GDPO), old_logprobs [B, T] and
sum_pi_squared [B, T] (the optimal token baseline).

`rewards` is either one score per sequence [B] (placed on the last response token where a per-token reward
is needed) or per-token rewards [B, T] (e.g. with a KL penalty from `kl.apply_kl_penalty`; summed over the
response where a score is needed). `group_ids` [B] (any integers, groups in any order) names each sample's
prompt. Masks may have holes (tool output inside a response): masked tokens are skipped, never credited.

A group of one sample gets advantage 0 in every group estimator (no comparison is possible); verl keeps its
raw score (mean 0) or raises (pass@k). Outcome estimators return the score on every token as `returns`,
where verl returns the advantages. The package README lists every departure from verl.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_algos.checks import as_bool_mask, check_2d, check_no_empty_rows, check_rows
from yatt_algos.groups import group_index, group_mean_std, group_sums
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


def gae(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
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


def grpo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
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


def rloo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al., arXiv 2402.14740): A_i = s_i - mean_{j != i} s_j = n / (n - 1) (s_i - mean_g).

    A group of one sample gets A = 0. returns = score.
    """
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    mean, _std, size = group_mean_std(scores, _require("group_ids", group_ids, "rloo"))
    adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), 0.0)
    return _broadcast(adv, mask), _broadcast(scores, mask)


def reinforce_pp(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, arXiv 2501.03262): discounted returns of the per-token rewards (the score plus any
    per-token KL penalty), whitened over all response tokens of the batch. returns = the raw returns."""
    mask = _mask_and_check(rewards, response_mask)
    returns = discounted_returns(_token_rewards(rewards, mask), mask, config.gamma)
    return masked_whiten(returns, mask, config.adv_eps), returns


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262 v2): the group mean score is subtracted (on the last token),
    then discounted returns are whitened over the batch, as in REINFORCE++.

    A group of one sample is its own mean, so its advantage is 0 before whitening (whitening then gives it
    -mean / std of the batch, like every other zero). verl subtracts 0 from such a sample (its raw score).
    """
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    mean, _std, _size = group_mean_std(scores, _require("group_ids", group_ids, "reinforce_pp_baseline"))
    token_rewards = _token_rewards(rewards, mask) - _token_rewards(mean, mask)
    returns = discounted_returns(token_rewards, mask, config.gamma)
    return masked_whiten(returns, mask, config.adv_eps), returns


def remax(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., arXiv 2310.10505): A_t = G_t - b, b the reward of the greedy response to the same
    prompt (baseline_rewards [B]); G_t the discounted return (gamma = 1: the score on every token)."""
    mask = _mask_and_check(rewards, response_mask)
    baseline = _require("baseline_rewards", baseline_rewards, "remax")
    check_rows("baseline_rewards", baseline, mask.shape[0])
    returns = discounted_returns(_token_rewards(rewards, mask), mask, config.gamma)
    return torch.where(mask, returns - baseline.unsqueeze(-1), 0.0), returns


def opo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585): the length-weighted
    group baseline b_g = sum_j |y_j| s_j / sum_j |y_j|, A_i = s_i - b_g on every token, no std division.
    |y| counts response tokens (holes excluded). returns = score."""
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    index, num_groups = group_index(_require("group_ids", group_ids, "opo"), mask.shape[0])
    lengths = mask.sum(dim=-1).to(torch.float64)  # [B]
    weighted = group_sums(lengths * scores.double(), index, num_groups) / group_sums(
        lengths, index, num_groups
    )
    size = group_sums(torch.ones_like(lengths), index, num_groups)[index]
    adv = torch.where(size > 1, scores - weighted[index].to(scores.dtype), 0.0)
    return _broadcast(adv, mask), _broadcast(scores, mask)


def gpg(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., arXiv 2504.02546): A_i = alpha (s_i - mean_g), no std division, with
    alpha = B / (number of non-zero scores in the batch), as verl computes it (the paper's alpha is
    B / (B - M), M the samples whose advantage is zero; with 0/1 rewards verl's counts the correct ones).
    B and the count are this call's. Pair with the "gpg" policy loss. returns = score."""
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    mean, _std, size = group_mean_std(scores, _require("group_ids", group_ids, "gpg"))
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = torch.where(size > 1, alpha * (scores - mean), 0.0)
    return _broadcast(adv, mask), _broadcast(scores, mask)


def grpo_passk(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (verl's "grpo_passk", after Tang et al., arXiv 2503.19595), k = the group size: only
    each group's best sample is credited, with its margin over the runner-up, A = s_max - s_second (divided
    by std_g + adv_eps when norm_by_std); all other samples get 0. Ties give 0 (the margin is 0).
    returns = score."""
    mask = _mask_and_check(rewards, response_mask)
    scores = _scores(rewards, mask)
    ids = _require("group_ids", group_ids, "grpo_passk")
    index, num_groups = group_index(ids, mask.shape[0])
    _mean, std, size = group_mean_std(scores, ids)
    best = scores.new_full((num_groups,), -torch.inf).scatter_reduce(0, index, scores, "amax")  # [G]
    position = torch.arange(scores.shape[0], device=scores.device)
    at_best = scores == best[index]
    first = position.new_full((num_groups,), scores.shape[0])
    first = first.scatter_reduce(0, index[at_best], position[at_best], "amin")  # one best sample per group
    chosen = position == first[index]
    others = torch.where(chosen, -torch.inf, scores)
    second = scores.new_full((num_groups,), -torch.inf).scatter_reduce(0, index, others, "amax")
    adv = best[index] - second[index]
    if config.norm_by_std:
        adv = adv / (std + config.adv_eps)
    adv = torch.where(chosen & (size > 1), adv, 0.0)
    return _broadcast(adv, mask), _broadcast(scores, mask)


def gdpo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242): group-decoupled normalization of several rewards. Each component k of
    reward_components [B, K] gets its own GRPO advantage (this module's `grpo`: std-normalized unless
    norm_by_std is False, 0 for one-sample groups); their sum weighted by gdpo_reward_weights (empty: all 1)
    is whitened over the batch's response tokens (`masked_whiten` with adv_eps). Without reward_components the
    one component is `rewards`. returns = the weighted score sum on every token."""
    mask = _mask_and_check(rewards, response_mask)
    ids = _require("group_ids", group_ids, "gdpo")
    components = _scores(rewards, mask).unsqueeze(-1) if reward_components is None else reward_components
    if components.dim() != 2 or components.shape[0] != mask.shape[0]:
        raise ValueError(
            f"reward_components must be [B, K] with B = {mask.shape[0]}, got {tuple(components.shape)}"
        )
    weights = config.gdpo_reward_weights or (1.0,) * components.shape[1]
    if len(weights) != components.shape[1]:
        raise ValueError(
            f"AlgoConfig.gdpo_reward_weights has {len(weights)} weights for {components.shape[1]} reward components"
        )
    total = torch.zeros(mask.shape, dtype=components.dtype, device=mask.device)
    for k, weight in enumerate(weights):
        adv_k, _returns = grpo(components[:, k], response_mask, config, group_ids=ids)
        total = total + weight * adv_k
    combined = (components * components.new_tensor(weights)).sum(-1)
    return masked_whiten(total, mask, config.adv_eps), _broadcast(combined, mask)


def sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """sum_v pi(v)^2 per position, in fp32, from logits [B, T, V] -> [B, T] (the optimal token baseline's
    input; computed where the logits are, i.e. beside the old logprobs)."""
    return torch.softmax(logits.float(), dim=-1).square().sum(dim=-1)


def _lone_tail(lengths: torch.Tensor, index: torch.Tensor, num_groups: int, width: int) -> torch.Tensor:
    """[B, width] bool: positions >= the group's second-largest token count, in the row whose token count
    (lengths [B]) is the group's unique largest: verl's handle_zero_tail, which counts tokens (the mask's
    sum), not last positions, so holes in a mask count as verl counts them."""
    columns = torch.arange(width, device=lengths.device)
    longest = lengths.new_full((num_groups,), -1).scatter_reduce(0, index, lengths, "amax")  # [G]
    at_longest = lengths == longest[index]
    runner_up = lengths.new_full((num_groups,), -1).scatter_reduce(
        0, index, torch.where(at_longest, -1, lengths), "amax"
    )
    count = torch.zeros(num_groups, dtype=torch.long, device=lengths.device).index_add_(
        0, index, at_longest.long()
    )
    unique = at_longest & (count[index] == 1) & (runner_up[index] >= 0)
    return unique.unsqueeze(-1) & (columns >= runner_up[index].unsqueeze(-1))


def _otb_inputs(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None,
    old_logprobs: torch.Tensor | None,
    sum_pi_squared: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Checks; returns mask, returns G [B, T], the path variance W [B, T] (0 at padding), group index."""
    mask = _mask_and_check(rewards, response_mask)
    ids = _require("group_ids", group_ids, name)
    named = (("old_logprobs", old_logprobs), ("sum_pi_squared", sum_pi_squared))
    old_logprobs = _require("old_logprobs", old_logprobs, name)
    sum_pi_squared = _require("sum_pi_squared", sum_pi_squared, name)
    for key, tensor in (*named, ("rollout_is_weights", rollout_is_weights)):
        if tensor is not None and tuple(tensor.shape) != tuple(mask.shape):
            raise ValueError(f"{key} has shape {tuple(tensor.shape)}, expected {tuple(mask.shape)}")
    returns = discounted_returns(_token_rewards(rewards, mask).float(), mask, 1.0)
    w = 1.0 - 2.0 * old_logprobs.float().exp() + sum_pi_squared.float()
    if rollout_is_weights is not None:  # W scaled by rho^2 to minimize the MSE under truncated IS (verl)
        w = w * rollout_is_weights.float().square()
    path = torch.where(mask, w, 0.0).cumsum(dim=-1)  # [B, T] W_t
    index, num_groups = group_index(ids, mask.shape[0])
    return mask, returns, path, index, num_groups


def _group_baseline(returns, path, valid, index, num_groups):
    """B = sum_i G W / (sum_i W + 1e-8) per group and column, over `valid` [B, L]; [B, L] fp32 (the sums
    in fp64)."""
    shape = (num_groups, returns.shape[1])
    num = torch.zeros(shape, dtype=torch.float64, device=returns.device)
    num = num.index_add_(0, index, torch.where(valid, returns * path, 0.0).double())
    den = torch.zeros(shape, dtype=torch.float64, device=returns.device)
    den = den.index_add_(0, index, torch.where(valid, path, 0.0).double())
    return (num / (den + 1e-8))[index].to(returns.dtype)


def optimal_token_baseline(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (verl's "optimal_token_baseline", arXiv 2602.07078): a baseline per
    position t, shared by the group, weighting each sample's return by its cumulative path variance.

    w_t = 1 - 2 pi_t + sum_v pi(v)^2 = ||e_{y_t} - pi||^2 (the squared norm of the logits' score; pi_t =
    exp(old_logprobs), sum_pi_squared [B, T] from `sum_pi_squared`), times rho_t^2 when rollout_is_weights
    [B, T] are given (verl's truncated-IS correction), W_t = sum_{j <= t} w_j over response tokens, G_t the
    reward-to-go (gamma = 1); B_t = sum_i G_t W_t / (sum_i W_t + 1e-8) over the group's samples that have a
    response token at position t; A_t = G_t - B_t. [B, T]. With otb_handle_zero_tail (verl's
    handle_zero_tail), where a group's longest response by token count (if unique) runs past the second
    longest's count, its baseline from that position on is 0. A one-sample group gets 0 (verl keeps its
    return). returns = G. Computed in fp32 with fp64 group sums (verl keeps the input dtype).
    """
    mask, returns, path, index, num_groups = _otb_inputs(
        rewards,
        response_mask,
        group_ids,
        old_logprobs,
        sum_pi_squared,
        rollout_is_weights,
        "optimal_token_baseline",
    )
    baseline = _group_baseline(returns, path, mask, index, num_groups)
    if config.otb_handle_zero_tail:
        tail = _lone_tail(mask.sum(-1), index, num_groups, mask.shape[1])
        baseline = torch.where(tail, 0.0, baseline)
    size = group_sums(torch.ones(mask.shape[0], device=mask.device), index, num_groups)[index]
    adv = torch.where(mask & (size > 1).unsqueeze(-1), returns - baseline, 0.0)
    return adv, returns


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, max count]: each row's response-token values packed to the left, 0 after them."""
    lengths = mask.sum(-1)
    out = x.new_zeros(x.shape[0], int(lengths.max()) if x.shape[0] else 0)
    packed = torch.arange(out.shape[1], device=x.device)[None] < lengths[:, None]
    out[packed] = x[mask]
    return out


def tir_optimal_token_baseline(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    group_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-turn (tool-integrated) optimal token baseline (verl's "tir_optimal_token_baseline"): as
    `optimal_token_baseline`, but each sample's response tokens are first packed to the left (the mask may
    have holes: tool outputs between turns), so the baseline at the k-th generated token is shared across
    the group whatever position it sits at; advantages are scattered back to the tokens. The zero tail
    (otb_handle_zero_tail; verl's default for this estimator is on) is by token count. A one-sample group
    keeps its return as its advantage (verl). [B, T] -> advantages [B, T], returns G [B, T].
    """
    mask, returns, path, index, num_groups = _otb_inputs(
        rewards,
        response_mask,
        group_ids,
        old_logprobs,
        sum_pi_squared,
        rollout_is_weights,
        "tir_optimal_token_baseline",
    )
    adv = torch.zeros_like(returns)
    if not mask.any():
        return adv, returns
    lengths = mask.sum(-1)
    g, w = _compact(returns, mask), _compact(path, mask)  # [B, L]
    width = g.shape[1]
    # verl: rows without tokens are in no group; one-sample groups get baseline 0
    has = lengths > 0
    size = torch.zeros(num_groups, device=mask.device).index_add_(0, index, has.float())[index]
    # verl sums over every row of the group at each packed column (a shorter row contributes 0 there)
    valid = has.unsqueeze(-1).expand(-1, width)
    baseline = torch.where((size > 1).unsqueeze(-1), _group_baseline(g, w, valid, index, num_groups), 0.0)
    if config.otb_handle_zero_tail:
        baseline = torch.where(
            _lone_tail(torch.where(has, lengths, -1), index, num_groups, width), 0.0, baseline
        )
    packed = torch.arange(width, device=mask.device)[None] < lengths[:, None]
    adv[mask] = (g - baseline)[packed]
    return adv, returns


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "remax": remax,
    "opo": opo,
    "gpg": gpg,
    "grpo_passk": grpo_passk,
    "gdpo": gdpo,
    "optimal_token_baseline": optimal_token_baseline,
    "tir_optimal_token_baseline": tir_optimal_token_baseline,
}


def compute_advantages(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    **kwargs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to `ADVANTAGE_ESTIMATORS[config.adv_estimator]`."""
    return ADVANTAGE_ESTIMATORS[config.adv_estimator](rewards, response_mask, config, **kwargs)
