"""The advantage estimators ported from verl (OPO, GPG, pass@k, GDPO, the optimal token baseline) and the
one-sample rule of REINFORCE++-baseline: hand-worked values (the working is in the comments), bad input."""

import math

import pytest
import torch
from yatt_algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    gdpo,
    gpg,
    grpo,
    grpo_passk,
    masked_whiten,
    opo,
    optimal_token_baseline,
    reinforce_pp_baseline,
    sum_pi_squared,
)
from yatt_algos.types import AlgoConfig

CFG = AlgoConfig()


def _rows(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The one advantage of each row (outcome estimators put the same value on every response token)."""
    return torch.where(mask, adv, 0.0).sum(-1) / mask.sum(-1)


def test_opo_length_weighted_baseline():
    # group 7: lengths 2, 3 (a hole at t = 1), 1 and scores 1, 0, 1: b = (2*1 + 3*0 + 1*1) / 6 = 0.5
    # -> A = (0.5, -0.5, 0.5); group 3 has one sample -> 0 (verl would give it its raw score 5)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]).bool()
    scores = torch.tensor([1.0, 0.0, 1.0, 5.0])
    adv, returns = opo(scores, mask, CFG, group_ids=torch.tensor([7, 7, 7, 3]))
    torch.testing.assert_close(_rows(adv, mask), torch.tensor([0.5, -0.5, 0.5, 0.0]))
    assert (adv[~mask] == 0).all() and (adv[1] == torch.tensor([-0.5, 0.0, -0.5, -0.5])).all()
    torch.testing.assert_close(_rows(returns, mask), scores)


def test_gpg_alpha_counts_nonzero_scores():
    # B = 6, 4 non-zero scores: alpha = 1.5. Group a: mean 1/3 -> 1.5 * (2/3, -1/3, -1/3) = (1, -0.5, -0.5);
    # group b is all 1 -> 0
    mask = torch.ones(6, 2, dtype=torch.bool)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv, _ = gpg(scores, mask, CFG, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(_rows(adv, mask), torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))


def test_grpo_passk_credits_only_the_best_sample():
    # group 0: (0.2, 0.9, 0.5): the best (0.9) gets its margin over 0.5, 0.4, / unbiased std;
    # group 1 ties at 1.0 -> margin 0; group 2 has one sample -> 0
    mask = torch.ones(6, 3, dtype=torch.bool)
    scores = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.7])
    ids = torch.tensor([0, 0, 0, 5, 5, 9])
    std = math.sqrt(((0.2 - 1.6 / 3) ** 2 + (0.9 - 1.6 / 3) ** 2 + (0.5 - 1.6 / 3) ** 2) / 2)  # 0.351188
    adv, _ = grpo_passk(scores, mask, CFG, group_ids=ids)
    want = torch.tensor([0.0, 0.4 / (std + 1e-6), 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(_rows(adv, mask), want)
    adv, _ = grpo_passk(scores, mask, AlgoConfig(norm_by_std=False), group_ids=ids)
    torch.testing.assert_close(_rows(adv, mask), torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0, 0.0]))


def test_gdpo_normalizes_each_component_then_whitens():
    # groups (0, 0, 1, 1), two components, weights (1, 2), every response 2 tokens long.
    # component 0 = (1, 0, 1, 1): group 0 -> +-0.5 / std(1, 0) = +-0.707107; group 1 is constant -> 0
    # component 1 = (0.5, 0.1, 0.2, 0.6): each group's pair -> +-0.707107 (any pair normalizes to that)
    # sums: (0.7071 + 2 * 0.7071, -3 * 0.7071, -2 * 0.7071, 2 * 0.7071) = (2.1213, -2.1213, -1.4142, 1.4142)
    # whitened over 8 tokens: mean 0, unbiased var = 2 * (4.5 + 4.5 + 2 + 2) / 7
    mask = torch.ones(4, 2, dtype=torch.bool)
    comps = torch.tensor([[1.0, 0.5], [0.0, 0.1], [1.0, 0.2], [1.0, 0.6]])
    cfg = AlgoConfig(adv_estimator="gdpo", gdpo_reward_weights=(1.0, 2.0))
    z = 0.5 / (math.sqrt(0.5) + 1e-6)  # one GRPO advantage of a two-sample group
    sums = torch.tensor([3 * z, -3 * z, -2 * z, 2 * z])
    std = math.sqrt(2 * float(sums.square().sum()) / 7)
    adv, returns = ADVANTAGE_ESTIMATORS["gdpo"](
        comps[:, 0], mask, cfg, group_ids=torch.tensor([0, 0, 1, 1]), reward_components=comps
    )
    torch.testing.assert_close(_rows(adv, mask), sums / (std + 1e-6))
    torch.testing.assert_close(_rows(returns, mask), torch.tensor([2.0, 0.2, 1.4, 2.2]))  # 1 * c0 + 2 * c1


def test_gdpo_without_components_is_whitened_grpo_and_checks_weights():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]).bool()
    scores, ids = torch.tensor([1.0, 0.0, 0.3, 0.6]), torch.tensor([1, 1, 2, 2])
    adv, _ = gdpo(scores, mask, CFG, group_ids=ids)
    want = masked_whiten(grpo(scores, mask, CFG, group_ids=ids)[0], mask, CFG.adv_eps)
    torch.testing.assert_close(adv, want)
    with pytest.raises(
        ValueError, match=r"AlgoConfig\.gdpo_reward_weights has 2 weights for 1 reward components"
    ):
        gdpo(scores, mask, AlgoConfig(gdpo_reward_weights=(1.0, 1.0)), group_ids=ids)
    with pytest.raises(ValueError, match=r"reward_components must be \[B, K\] with B = 4, got \(3, 2\)"):
        gdpo(scores, mask, CFG, group_ids=ids, reward_components=torch.zeros(3, 2))


def test_optimal_token_baseline_hand_worked():
    # w_t = 1 - 2 pi_t + sum pi^2. Row 0: pi = 0.5, sum 0.5 -> w = 0.5, W = (0.5, 1.0, 1.5), score 1 -> G = 1.
    # Row 1 (length 2): pi = 0.25, sum 0.5 -> w = 1, W = (1, 2), score 0 -> G = 0.
    # B_0 = (1 * 0.5 + 0 * 1) / 1.5 = 1/3; B_1 = (1 * 1 + 0 * 2) / 3 = 1/3; B_2 = 1 * 1.5 / 1.5 = 1 (row 0 only)
    # A row 0 = (2/3, 2/3, 0), row 1 = (-1/3, -1/3, masked). Row 2 is alone in its group -> 0.
    # Zero tail (the default): row 0 alone runs past row 1's end, so B_2 = 0 there and A = G = 1.
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]]).bool()
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.9], [0.3, 0.3, 0.3]]))
    spsq = torch.full((3, 3), 0.5)
    adv, returns = optimal_token_baseline(
        torch.tensor([1.0, 0.0, 2.0]),
        mask,
        CFG,
        group_ids=torch.tensor([4, 4, 8]),
        old_logprobs=old,
        sum_pi_squared=spsq,
    )
    want = torch.tensor([[2 / 3, 2 / 3, 1.0], [-1 / 3, -1 / 3, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    no_tail = AlgoConfig(otb_handle_zero_tail=False)
    adv, _ = optimal_token_baseline(
        torch.tensor([1.0, 0.0, 2.0]),
        mask,
        no_tail,
        group_ids=torch.tensor([4, 4, 8]),
        old_logprobs=old,
        sum_pi_squared=spsq,
    )
    torch.testing.assert_close(adv[0], torch.tensor([2 / 3, 2 / 3, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 2.0, 2.0]]))
    with pytest.raises(ValueError, match="optimal_token_baseline needs sum_pi_squared"):
        optimal_token_baseline(torch.ones(3), mask, CFG, group_ids=torch.tensor([4, 4, 8]), old_logprobs=old)


def test_sum_pi_squared_from_logits():
    # logits (0, 0) -> pi = (0.5, 0.5) -> 0.5; (log 3, 0) -> (0.75, 0.25) -> 0.625
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    torch.testing.assert_close(sum_pi_squared(logits), torch.tensor([[0.5, 0.625]]))


def test_reinforce_pp_baseline_one_sample_group_is_zero_before_whitening():
    # group 1: (1, 0) -> (0.5, -0.5); group 2 (one sample, score 3) is its own mean -> 0 (verl: 3)
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv, returns = reinforce_pp_baseline(
        torch.tensor([1.0, 0.0, 3.0]), mask, CFG, group_ids=torch.tensor([1, 1, 2])
    )
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]]))
    # whitened over 6 tokens: mean 0, unbiased std sqrt(4 * 0.25 / 5)
    torch.testing.assert_close(adv, returns / (math.sqrt(0.2) + 1e-6))


def test_group_estimators_need_group_ids():
    for name in ("opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"):
        with pytest.raises(ValueError, match=f"{name} needs group_ids"):
            ADVANTAGE_ESTIMATORS[name](torch.ones(2), torch.ones(2, 2), CFG)


def test_optimal_token_baseline_zero_tail_needs_a_unique_longest_response():
    # rows 0 and 1 both end at t = 2, row 2 at t = 0; w = 1 everywhere (pi = 0.5, sum pi^2 = 1):
    # W row 0, 1 = (1, 2, 3), row 2 = (1). Scores (1, 0, 0). t = 2: B = (1 * 3 + 0 * 3) / 6 = 0.5 for both,
    # no zero tail (two rows share the latest end); t = 1: (1 * 2) / 4 = 0.5; t = 0: 1 / 3
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]]).bool()
    adv, _ = optimal_token_baseline(
        torch.tensor([1.0, 0.0, 0.0]),
        mask,
        CFG,
        group_ids=torch.zeros(3, dtype=torch.long),
        old_logprobs=torch.full((3, 3), math.log(0.5)),
        sum_pi_squared=torch.ones(3, 3),
    )
    want = torch.tensor([[2 / 3, 0.5, 0.5], [-1 / 3, -0.5, -0.5], [-1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
