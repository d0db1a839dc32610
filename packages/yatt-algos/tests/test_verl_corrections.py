"""What else verl users bring: abs and straight-through KL, token-sum aggregation, IcePop's lower bound, IS
batch normalization, rejection sampling, pf-PPO resampling, and that every new name is selectable from (and
validated by) `AlgoConfig`. Hand-worked values; the working is in the comments."""

import math

import msgspec
import pytest
import torch
from yatt_algos.aggregation import aggregate
from yatt_algos.kl import kl_penalty
from yatt_algos.pf_ppo import pf_ppo_resample, pf_ppo_weights
from yatt_algos.policy_losses import ppo_clip
from yatt_algos.rollout_correction import rejection_mask, rollout_is_weights
from yatt_algos.types import AlgoConfig


def _logs(ratios) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) logprobs [1, T] whose ratio pi_old / pi_rollout is `ratios`."""
    rollout = torch.full((1, len(ratios)), -1.0)
    return rollout + torch.log(torch.tensor([ratios])), rollout


@pytest.mark.parametrize(
    ("name", "base"), [("k1+", "k1"), ("k3+", "k3"), ("abs+", "abs"), ("low_var_kl+", "k3")]
)
def test_straight_through_kl_has_the_estimates_value_and_k2s_gradient(name, base):
    # lp = (-1, -2), ref = (-1.5, -1.5): k2's gradient is lp - ref = (0.5, -0.5)
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.5]])
    value = kl_penalty(lp, ref, name)
    torch.testing.assert_close(value, kl_penalty(lp, ref, base))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5, -0.5]]))


def test_abs_kl_and_low_var_kl_alias():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]])
    torch.testing.assert_close(kl_penalty(lp, ref, "abs"), torch.tensor([[0.5, 0.5]]))
    # k3 at x = -0.5 and x = +0.5: e^-0.5 + 0.5 - 1 = 0.106531, e^0.5 - 0.5 - 1 = 0.148721
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), torch.tensor([[0.1065307, 0.1487213]]))


def test_token_sum_aggregation():
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert aggregate(values, mask, "token-sum").item() == 15.0  # 1 + 2 + 3 + 4 + 5; the masked 9 never counts
    # additive over micro-batches without any global count
    parts = aggregate(values[:1], mask[:1], "token-sum") + aggregate(values[1:], mask[1:], "token-sum")
    assert parts.item() == 15.0


def test_icepop_masks_weights_outside_both_bounds():
    # w = (0.4, 1.0, 3.0, 0.6), mask mode, [0.5, 2]: (0, 1, 0, 0.6)
    old, rollout = _logs([0.4, 1.0, 3.0, 0.6])
    mask = torch.ones(1, 4, dtype=torch.bool)
    w, m = rollout_is_weights(
        old, rollout, mask, level="token", mode="mask", threshold=2.0, threshold_lower=0.5
    )
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0, 0.6]]))
    assert (m["rollout_is_over_frac"].item(), m["rollout_is_under_frac"].item()) == (0.25, 0.25)
    with pytest.raises(
        ValueError, match="threshold_lower > 0 \\(IcePop\\) needs mode 'mask', got 'truncate'"
    ):
        rollout_is_weights(
            old, rollout, mask, level="token", mode="truncate", threshold=2.0, threshold_lower=0.5
        )


def test_is_batch_normalization_token_and_sequence():
    # token: w = (1, 2, 3) truncated at 2.5 -> (1, 2, 2.5), mean 5.5 / 3 -> (0.545455, 1.090909, 1.363636)
    old, rollout = _logs([1.0, 2.0, 3.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, _ = rollout_is_weights(
        old, rollout, mask, level="token", mode="truncate", threshold=2.5, batch_normalize=True
    )
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 2.5]]) / (5.5 / 3))
    # sequence: row 0 (3 tokens, product 2), row 1 (1 token, 0.5): the mean is over sequences, 1.25
    # (a token mean would be (3 * 2 + 0.5) / 4 = 1.625) -> (1.6, 0.4)
    old = torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w, _ = rollout_is_weights(
        old, torch.zeros(2, 3), mask, level="sequence", mode="truncate", threshold=5.0, batch_normalize=True
    )
    torch.testing.assert_close(w, torch.tensor([[1.6, 1.6, 1.6], [0.4, 1.0, 1.0]]))  # 1 where masked


def test_rejection_sampling_token_and_sequence():
    # token: w = (0.4, 1.0, 3.0, 1.9), bounds [1/2, 2]: keep (no, yes, no, yes)
    old, rollout = _logs([0.4, 1.0, 3.0, 1.9])
    mask = torch.ones(1, 4, dtype=torch.bool)
    keep, m = rejection_mask(old, rollout, mask, level="token", threshold=2.0)
    assert keep.tolist() == [[False, True, False, True]] and m["rollout_rs_masked_frac"].item() == 0.5
    # sequence: row 0 (1.5, 1.5) -> 2.25 > 2: the whole row goes; row 1 (1.5, 0.8) -> 1.2 stays;
    # with lower 0.25 row 2 (0.5, 0.6) -> 0.3 stays, without it (1/2) it goes
    old = torch.log(torch.tensor([[1.5, 1.5], [1.5, 0.8], [0.5, 0.6]]))
    mask = torch.ones(3, 2, dtype=torch.bool)
    keep, m = rejection_mask(old, torch.zeros(3, 2), mask, level="sequence", threshold=2.0)
    assert keep.tolist() == [[False, False], [True, True], [False, False]]
    assert m["rollout_rs_seq_masked_frac"].item() == pytest.approx(2 / 3)
    keep, _ = rejection_mask(
        old, torch.zeros(3, 2), mask, level="sequence", threshold=2.0, threshold_lower=0.25
    )
    assert keep.tolist() == [[False, False], [True, True], [True, True]]


def test_losses_apply_rejection_and_icepop_from_the_config():
    # ppo_clip at r = 1 with A = 1: loss -1, gradient -1 per token; rollout ratios (0.4, 1.0, 3.0)
    lp = torch.zeros(1, 3, requires_grad=True)
    old, rollout = _logs([0.4, 1.0, 3.0])
    old, rollout = old - old, rollout - old  # pi_old = pi (= exp 0) and the same pi_old / pi_rollout
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    cfg = AlgoConfig(rollout_rs_level="token", rollout_rs_threshold=2.0)
    loss, m = ppo_clip(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.0, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0, 0.0]]))
    assert m["rollout_rs_masked_frac"].item() == pytest.approx(2 / 3)
    cfg = AlgoConfig(
        rollout_is_level="token",
        rollout_is_mode="mask",
        rollout_is_threshold=2.0,
        rollout_is_threshold_lower=0.5,
    )
    loss, _ = ppo_clip(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.0, 0.0]]))


def test_pf_ppo_weights_and_resampling():
    scores = torch.tensor([-2.0, 0.5, 0.0])
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 2.0), torch.tensor([4.0, 0.25, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(scores, "max_min"), torch.tensor([1.0, 1.0, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(scores, "max_random"), torch.tensor([0.1, 0.4, 0.1]) + 1e-8)
    # max_min on (1, 0.5, 0): the middle score (weight 1e-8) is as good as never drawn
    cfg = AlgoConfig(pf_ppo_method="max_min")
    idx = torch.cat(
        [
            pf_ppo_resample(torch.tensor([1.0, 0.5, 0.0]), cfg, generator=torch.Generator().manual_seed(s))
            for s in range(200)
        ]
    )
    assert idx.shape == (600,) and (idx != 1).all() and 200 < int((idx == 0).sum()) < 400
    assert pf_ppo_resample(scores, AlgoConfig()).tolist() == [0, 1, 2]  # "none": the batch as it is
    with pytest.raises(ValueError, match="method 'top' is not one of"):
        pf_ppo_weights(scores, "top")


NEW_NAMES = [
    ("adv_estimator", ["opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"]),
    ("policy_loss", ["gmpo", "gpg", "sapo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "reinforce"]),
    ("kl_estimator", ["abs", "k1+", "k3+", "abs+", "low_var_kl", "low_var_kl+"]),
    ("loss_agg_mode", ["token-sum"]),
    ("rollout_rs_level", ["token", "sequence"]),
    ("pf_ppo_method", ["pow", "max_min", "max_random"]),
]


@pytest.mark.parametrize(("field", "names"), NEW_NAMES)
def test_config_accepts_new_names_and_rejects_unknown(field, names):
    for name in names:
        assert getattr(AlgoConfig(**{field: name}), field) == name
        assert (
            getattr(msgspec.json.decode(f'{{"{field}": "{name}"}}'.encode(), type=AlgoConfig), field) == name
        )
    with pytest.raises(ValueError, match=f"AlgoConfig.{field} 'vanilla' is not one of \\["):
        AlgoConfig(**{field: "vanilla"})
    with pytest.raises(msgspec.ValidationError, match=f"Invalid enum value 'vanilla' - at `\\$.{field}`"):
        msgspec.json.decode(f'{{"{field}": "vanilla"}}'.encode(), type=AlgoConfig)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sapo_tau_neg": 0.0}, r"AlgoConfig.sapo_tau_neg must be > 0, got 0.0"),
        ({"clip_cov_ratio": 0.0}, r"AlgoConfig.clip_cov_ratio must be in \(0, 1\], got 0.0"),
        ({"kl_cov_ratio": 2.0}, r"AlgoConfig.kl_cov_ratio must be in \(0, 1\], got 2.0"),
        ({"clip_cov_lb": 5.0}, r"AlgoConfig.clip_cov_lb must be < clip_cov_ub, got 5.0, 5.0"),
        ({"kl_cov_coef": -1.0}, r"AlgoConfig.kl_cov_coef must be >= 0, got -1.0"),
        ({"dppo_tv_low": 0.0}, r"AlgoConfig.dppo_tv_low must be > 0, got 0.0"),
        ({"dppo_is_cap": 0.5}, r"AlgoConfig.dppo_is_cap must be >= 1, got 0.5"),
        ({"gdpo_reward_weights": (1.0, -1.0)}, r"AlgoConfig.gdpo_reward_weights must be >= 0"),
        ({"pf_ppo_weight_pow": 0.0}, r"AlgoConfig.pf_ppo_weight_pow must be > 0, got 0.0"),
        ({"rollout_rs_threshold": 1.0}, r"AlgoConfig.rollout_rs_threshold must be > 1, got 1.0"),
        ({"rollout_rs_threshold_lower": 1.0}, r"AlgoConfig.rollout_rs_threshold_lower must be in \[0, 1\)"),
        (
            {"rollout_is_threshold_lower": 0.5},
            r"AlgoConfig.rollout_is_threshold_lower > 0 \(IcePop\) needs rollout_is_mode='mask', got 'truncate'",
        ),
        (
            {"rollout_is_threshold_lower": 3.0, "rollout_is_mode": "mask"},
            r"AlgoConfig.rollout_is_threshold_lower must be in \[0, rollout_is_threshold\), got 3.0",
        ),
    ],
)
def test_config_validates_new_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**kwargs)
