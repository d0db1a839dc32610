"""Advantage estimators: hand-worked values with non-contiguous groups, masks with holes, invariants,
zero-variance and singleton groups, bad input."""

import pytest
import torch
from yatt_algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, discounted_returns
from yatt_algos.types import AlgoConfig

CFG = AlgoConfig()
# groups 7 and 3 interleaved: group 7 = rows 0, 2, 4 with scores (1, 0, 0); group 3 = rows 1, 3 with (0, 1)
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])


def _first(adv):
    return adv[:, 0]


def test_grpo_hand_worked():
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.577350
    #   -> (2/3) / 0.577350 = 1.154701, (-1/3) / 0.577350 = -0.577350
    # group 3: mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.707107 -> -/+ 0.707107
    adv, returns = ADVANTAGE_ESTIMATORS["grpo"](SCORES, MASK, CFG, group_ids=GROUPS)
    torch.testing.assert_close(
        _first(adv), torch.tensor([1.154701, -0.707107, -0.577350, 0.707107, -0.577350])
    )
    assert (adv[~MASK.bool()] == 0).all() and (adv[2] == adv[2, 0]).all()  # broadcast over the response
    torch.testing.assert_close(returns[:, 0], SCORES)


def test_dr_grpo_hand_worked():
    # norm_by_std=False: s - group mean: group 7 (2/3, -1/3, -1/3), group 3 (-1/2, 1/2)
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](SCORES, MASK, AlgoConfig(norm_by_std=False), group_ids=GROUPS)
    torch.testing.assert_close(_first(adv), torch.tensor([2 / 3, -0.5, -1 / 3, 0.5, -1 / 3]))


def test_rloo_hand_worked():
    # s_i - mean of the others: group 7: 1 - 0 = 1, 0 - 0.5 = -0.5 (twice); group 3: 0 - 1 = -1, 1 - 0 = 1
    adv, _ = ADVANTAGE_ESTIMATORS["rloo"](SCORES, MASK, CFG, group_ids=GROUPS)
    torch.testing.assert_close(_first(adv), torch.tensor([1.0, -1.0, -0.5, 1.0, -0.5]))


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_advantages_sum_to_zero(name):
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(24, generator=gen)
    groups = torch.randint(0, 5, (24,), generator=gen) * 11  # arbitrary ids, shuffled membership
    adv, _ = ADVANTAGE_ESTIMATORS[name](scores, torch.ones(24, 4), CFG, group_ids=groups)
    for g in groups.unique():
        assert adv[groups == g, 0].sum().item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_zero_variance_and_singleton_groups_never_nan(name):
    # group 0: all equal; group 1: one sample
    scores = torch.tensor([0.5, 0.5, 0.5, 2.0])
    adv, _ = ADVANTAGE_ESTIMATORS[name](scores, torch.ones(4, 2), CFG, group_ids=torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(adv).all()
    if name != "reinforce_pp_baseline":
        assert adv.abs().max().item() == 0.0


def test_gae_hand_worked_with_a_hole():
    # gamma 0.9, lam 0.8, score 1 on the last token, V = (0.5, 0.4, 0.3) on tokens 0, 2, 3 (token 1 masked):
    #   t3: delta = 1 - 0.3 = 0.7, A = 0.7
    #   t2: delta = 0.9 * 0.3 - 0.4 = -0.13, A = -0.13 + 0.72 * 0.7 = 0.374
    #   t0: delta = 0.9 * 0.4 - 0.5 = -0.14, A = -0.14 + 0.72 * 0.374 = 0.12928
    cfg = AlgoConfig(adv_estimator="gae", gamma=0.9, lam=0.8)
    values = torch.tensor([[0.5, 99.0, 0.4, 0.3]])
    adv, ret = compute_advantages(torch.tensor([1.0]), torch.tensor([[1, 0, 1, 1]]), cfg, values=values)
    torch.testing.assert_close(adv, torch.tensor([[0.12928, 0.0, 0.374, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[0.62928, 0.0, 0.774, 1.0]]))  # A + V


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    token_rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.3, 0.2, 0.1]])
    adv, _ = ADVANTAGE_ESTIMATORS["gae"](token_rewards, torch.ones(1, 3), CFG, values=values)
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.6, 0.9]]))  # (0.9, 0.8, 1.0) - V


def test_reinforce_pp_hand_worked():
    # gamma 0.5, scores (1, 0) on the last of two tokens: returns (0.5, 1), (0, 0);
    # whitened over 4 tokens: mean 0.375, unbiased std sqrt(0.6875 / 3) = 0.478714
    cfg = AlgoConfig(gamma=0.5)
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp"](torch.tensor([1.0, 0.0]), torch.ones(2, 2), cfg)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.261116, 1.305582], [-0.783349, -0.783349]]))


def test_reinforce_pp_baseline_hand_worked():
    # group mean 0.5 -> (0.5, -0.5) on the last token, gamma 1 -> returns +-0.5 on both tokens;
    # whitened: mean 0, unbiased std sqrt(1 / 3) -> +-0.866025
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](
        torch.tensor([1.0, 0.0]), torch.ones(2, 2), CFG, group_ids=torch.tensor([4, 4])
    )
    torch.testing.assert_close(adv, torch.tensor([[0.866025, 0.866025], [-0.866025, -0.866025]]))


def test_remax_hand_worked():
    # score - greedy baseline on every token: 1 - 0.5, 0 - 0.5
    adv, _ = ADVANTAGE_ESTIMATORS["remax"](
        torch.tensor([1.0, 0.0]), torch.ones(2, 2), CFG, baseline_rewards=torch.tensor([0.5, 0.5])
    )
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))


def test_discounted_returns_skip_holes():
    # gamma 0.5 over tokens 0, 2, 3 (token 1 masked): G3 = 1, G2 = 0 + 0.5, G0 = 0 + 0.25
    out = discounted_returns(torch.tensor([[0.0, 9.0, 0.0, 1.0]]), torch.tensor([[1, 0, 1, 1]]).bool(), 0.5)
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.0, 0.5, 1.0]]))


def test_registry_matches_the_config_literal():
    from typing import get_args

    from yatt_algos.types import AdvantageEstimator

    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(get_args(AdvantageEstimator))


def test_bad_input():
    grpo = ADVANTAGE_ESTIMATORS["grpo"]
    with pytest.raises(ValueError, match="grpo needs group_ids"):
        grpo(SCORES, MASK, CFG)
    with pytest.raises(ValueError, match=r"group_ids must have shape \(5,\), got \(4,\)"):
        grpo(SCORES, MASK, CFG, group_ids=GROUPS[:4])
    with pytest.raises(ValueError, match=r"response_mask rows \[1\] are all masked"):
        grpo(SCORES, MASK * torch.tensor([[1], [0], [1], [1], [1]]), CFG, group_ids=GROUPS)
    with pytest.raises(ValueError, match="response_mask is empty: the batch has no sequences"):
        grpo(torch.zeros(0), torch.zeros(0, 3), CFG, group_ids=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rewards must be \[B\] or \[B, T\] like response_mask"):
        grpo(torch.zeros(5, 2), MASK, CFG, group_ids=GROUPS)
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        grpo(SCORES, MASK, CFG, group_ids=GROUPS.float())
    with pytest.raises(ValueError, match="gae needs values"):
        ADVANTAGE_ESTIMATORS["gae"](SCORES, MASK, CFG)
    with pytest.raises(ValueError, match="remax needs baseline_rewards"):
        ADVANTAGE_ESTIMATORS["remax"](SCORES, MASK, CFG)
