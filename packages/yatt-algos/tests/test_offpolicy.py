"""The verl functions added in 0.4.0 (issue 32): DRO, the rejection criteria, the IS and off-policy
diagnostics, bypass mode, the KL controllers, OTB with rollout IS weights and its zero tail by token count,
the TIR optimal token baseline and KL-Cov over valid tokens. Hand-worked values (working in comments) and
gradients."""

import math

import pytest
import torch
from yatt_algos.advantages import optimal_token_baseline, tir_optimal_token_baseline
from yatt_algos.kl import AdaptiveKLController, FixedKLController, kl_controller
from yatt_algos.offpolicy import (
    bypass_mode,
    compute_is_metrics,
    compute_offpolicy_metrics,
    rejection_criteria_mask,
)
from yatt_algos.policy_losses import POLICY_LOSSES, ppo_clip
from yatt_algos.types import AlgoConfig

CFG = AlgoConfig()


def test_dro_values_and_gradient_by_hand():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = POLICY_LOSSES["dro"](lp, old, adv, mask, AlgoConfig(dro_beta=0.5))
    # t0: -(1 * -1 - 0.25 * 0.5^2) = 1.0625; t1: -(-2 * -2 - 0) = -4; padding 0
    torch.testing.assert_close(loss, torch.tensor([[1.0625, -4.0, 0.0]]))
    loss.sum().backward()
    # d/dlp = -A + beta (lp - old): t0 -1 + 0.5 * 0.5 = -0.75; t1 2 + 0 = 2
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.75, 2.0, 0.0]]))
    assert float(metrics["clip_frac"]) == 0.0


LR = torch.tensor([[0.1, -0.5, 2.0], [0.2, 0.0, 9.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize(
    "criteria,threshold,keep",
    [
        # k2 = lr^2 / 2: row 0 [0.005, 0.125, 2.0], row 1 [0.02, 0]
        ("token_k2", 0.5, [[1, 1, 0], [1, 1, 0]]),
        # k3 = e^x - 1 - x: k3(2) = 4.389 > 1, k3(-0.5) = 0.1065
        ("token_k3", 1.0, [[1, 1, 0], [1, 1, 0]]),
        # sums of k2: 2.13 (rejected), 0.02
        ("seq_sum_k2", 1.0, [[0, 0, 0], [1, 1, 0]]),
        # sums of k3: 4.501, 0.0214 (k3(0.1) = 0.00517)
        ("seq_sum_k3", 4.4, [[0, 0, 0], [1, 1, 0]]),
        ("seq_sum_k3", 4.6, [[1, 1, 1], [1, 1, 0]]),
        # means of k1 = -lr: -0.5333, -0.1; bounds log(0.9) = -0.1054, log(1.5) = 0.405
        ("seq_mean_k1", "0.9_1.5", [[0, 0, 0], [1, 1, 0]]),
        # one k1 number is the upper bound, lower = 1 / upper: log bounds [-0.693, 0.693]
        ("seq_mean_k1", 2.0, [[1, 1, 1], [1, 1, 0]]),
        ("seq_mean_k2", 0.5, [[0, 0, 0], [1, 1, 0]]),  # 0.71, 0.01
        ("seq_mean_k3", 1.5, [[1, 1, 1], [1, 1, 0]]),  # 1.500 < 1.5? 4.501 / 3 = 1.5004: rejected below
        ("seq_mean_k3", 1.6, [[1, 1, 1], [1, 1, 0]]),
        ("seq_max_k2", 1.0, [[0, 0, 0], [1, 1, 0]]),  # max 2.0, 0.02
        ("seq_max_k3", 5.0, [[1, 1, 1], [1, 1, 0]]),  # max 4.389
        # token k1 = -lr in [log 0.6, log 1.2] = [-0.511, 0.182]: lr 0.1 -> -0.1 ok, -0.5 -> 0.5 no, 2 -> -2 no
        ("token_k1", "0.6_1.2", [[1, 0, 0], [1, 1, 0]]),
        # chained: token_k2 drops row 0's last token; seq_max_k3 at 5 drops nothing
        ("token_k2, seq_max_k3", "0.5,5.0", [[1, 1, 0], [1, 1, 0]]),
        ("token_k2,seq_sum_k2", 0.5, [[0, 0, 0], [1, 1, 0]]),
    ],
)
def test_rejection_criteria_by_hand(criteria, threshold, keep):
    if criteria == "seq_mean_k3" and threshold == 1.5:
        keep = [[0, 0, 0], [1, 1, 0]]  # (e^2 - 3 + 0.1065 + 0.00517) / 3 = 1.5004 > 1.5
    mask, metrics = rejection_criteria_mask(LR, MASK, criteria, threshold)
    assert mask.tolist() == torch.tensor(keep, dtype=torch.bool).tolist()
    rejected = 5 - int(mask.sum())
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(rejected / 5)


def test_rejection_criteria_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown rejection criteria.*seq_max_k1"):
        rejection_criteria_mask(LR, MASK, "seq_max_k1", 1.0)
    with pytest.raises(ValueError, match="only k1 criteria take 'lower_upper'"):
        rejection_criteria_mask(LR, MASK, "token_k2", "0.1_1")
    with pytest.raises(ValueError, match="give one threshold or 2"):
        rejection_criteria_mask(LR, MASK, "token_k2,token_k3", "1,2,3")


def test_is_metrics_by_hand():
    w = torch.tensor([[1.0, 2.0], [0.5, 7.0]])
    mask = torch.tensor([[True, True], [True, False]])
    m = compute_is_metrics(w, w.log(), mask, "token", 2.0)
    # valid weights 1, 2, 0.5 (all inside [0.5, 2]): mean 7/6, E[w^2] = 5.25 / 3 = 1.75
    assert m["rollout_is_mean"] == pytest.approx(7 / 6)
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(1.75 - (7 / 6) ** 2))
    assert m["rollout_is_eff_sample_size"] == pytest.approx((7 / 6) ** 2 / 1.75, rel=1e-6)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (2.0, 0.5)
    assert m["rollout_is_ratio_fraction_high"] == 0.0
    # row means 1.5 and 0.5
    assert m["rollout_is_seq_mean"] == pytest.approx(1.0)
    assert m["rollout_is_seq_std"] == pytest.approx(math.sqrt(0.5))
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(0.5)
    assert m["rollout_is_seq_fraction_low"] == 0.0


def test_offpolicy_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0]])
    roll = torch.tensor([[-1.5, -2.0]])
    m = compute_offpolicy_metrics(old, roll, torch.ones(1, 2, dtype=torch.bool))
    assert m["training_ppl"] == pytest.approx(math.exp(1.5))
    assert m["rollout_ppl"] == pytest.approx(math.exp(1.75))
    assert m["kl"] == pytest.approx(-0.25)
    assert m["k3_kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2)
    assert m["log_ppl_diff"] == pytest.approx(-0.25)
    assert m["ppl_ratio"] == pytest.approx(math.exp(-0.25))
    assert m["chi2_token"] == pytest.approx((math.e + 1) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(math.e - 1)
    assert set(compute_offpolicy_metrics(old, None, torch.ones(1, 2, dtype=torch.bool))) == {
        "training_ppl",
        "training_log_ppl",
    }


def test_bypass_reinforce_with_token_is_by_hand():
    lp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    roll = torch.tensor([[-1.2, -2.0]])
    adv = torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, kept, metrics = bypass_mode(
        lp, roll, adv, mask, CFG, loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0
    )
    w = torch.tensor([[math.exp(0.2), 2.0]])  # exp(1.5) = 4.48 truncated at 2
    torch.testing.assert_close(loss, -adv * lp.detach() * w)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -adv * w)  # the weight is detached
    assert kept.all() and metrics["rollout_is_mean"] == pytest.approx(float(w.mean()))


def test_bypass_ppo_clip_with_rejection_equals_ppo_on_kept_tokens():
    lp = torch.tensor([[-1.0, -0.5, -3.0]], requires_grad=True)
    roll = torch.tensor([[-1.1, -2.0, -3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, kept, metrics = bypass_mode(
        lp,
        roll,
        adv,
        mask,
        CFG,
        loss_type="ppo_clip",
        rollout_is="token",
        rollout_rs="token_k2",
        rollout_rs_threshold=0.5,
    )
    # k2 = [0.005, 1.125, 0]: the second token is rejected; no IS weight on PPO-clip
    assert kept.tolist() == [[True, False, True]]
    ref, _ = ppo_clip(lp, roll, adv, kept, CFG)
    torch.testing.assert_close(loss, ref)
    loss.sum().backward()
    assert float(lp.grad[0, 1]) == 0.0 and float(lp.grad[0, 0]) == pytest.approx(-math.exp(0.1))
    assert metrics["rollout_rs_token_k2_masked_fraction"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="loss_type must be 'reinforce' or 'ppo_clip'"):
        bypass_mode(lp, roll, adv, mask, CFG, loss_type="vanilla")


def test_registered_bypass_mode_reads_its_config():
    lp, roll = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.2, -2.0]])
    adv, mask = torch.tensor([[2.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool)
    cfg = AlgoConfig(
        policy_loss="bypass_mode",
        bypass_loss_type="reinforce",
        rollout_is_level="token",
        bypass_rs_criteria="token_k2",
        bypass_rs_threshold="1.0",
    )
    loss, _ = POLICY_LOSSES["bypass_mode"](lp, roll, adv, mask, cfg)
    # k2(1.5) = 1.125 > 1: second token rejected; first: -2 * -1 * exp(0.2)
    torch.testing.assert_close(loss, torch.tensor([[2.0 * math.exp(0.2), 0.0]]))


def test_kl_controllers():
    ctl = kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(0.1, 10)  # error clip(0.1 / 0.05 - 1) = 0.2; 0.1 * (1 + 0.2 * 10 / 100)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(0.045, 10)  # error -0.1: * 0.99
    assert ctl.value == pytest.approx(0.102 * 0.99)
    fixed = kl_controller("fixed", 0.3)
    fixed.update(10.0, 5)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        kl_controller("pid", 0.1)


def test_otb_with_rollout_is_weights_by_hand():
    # one group of two one-token... two-token responses; pi = exp(old) = 0.5, sum pi^2 = 0.5 -> w = 0.5
    mask = torch.ones(2, 2, dtype=torch.bool)
    old = torch.full((2, 2), math.log(0.5))
    spi = torch.full((2, 2), 0.5)
    rho = torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    adv, _ = optimal_token_baseline(
        torch.tensor([1.0, 0.0]),
        mask,
        CFG,
        group_ids=torch.tensor([0, 0]),
        old_logprobs=old,
        sum_pi_squared=spi,
        rollout_is_weights=rho,
    )
    # w * rho^2: row 0 [0.5, 2.0] -> W [0.5, 2.5]; row 1 [0.5, 0.5] -> W [0.5, 1.0]; G row 0 = 1, row 1 = 0
    b = torch.tensor([0.5 / 1.0, 2.5 / 3.5])
    torch.testing.assert_close(adv, torch.stack([1 - b, -b]), atol=1e-6, rtol=0)


def test_otb_zero_tail_counts_tokens_as_verl():
    # both rows have 3 tokens; row 0's last one sits later (a hole). verl counts tokens: no unique longest,
    # so no zero tail: row 0's last position has only itself in the group, baseline = its own return
    mask = torch.tensor([[True, False, True, True], [True, True, True, False]])
    old, spi = torch.full((2, 4), math.log(0.5)), torch.full((2, 4), 0.5)
    adv, _ = optimal_token_baseline(
        torch.tensor([1.0, 0.0]),
        mask,
        CFG,
        group_ids=torch.tensor([0, 0]),
        old_logprobs=old,
        sum_pi_squared=spi,
    )
    assert abs(float(adv[0, 3])) < 1e-6  # the zero tail would have given 1
    # a unique longest by count: zeroed from the second-longest count on
    mask2 = torch.tensor([[True, True, True, True], [True, True, False, False]])
    adv2, _ = optimal_token_baseline(
        torch.tensor([1.0, 0.0]),
        mask2,
        CFG,
        group_ids=torch.tensor([0, 0]),
        old_logprobs=torch.full((2, 4), math.log(0.5)),
        sum_pi_squared=spi,
    )
    assert adv2[0, 2:].tolist() == [1.0, 1.0]


def _tir_reference(rewards, mask, ids, w, zero_tail):
    """verl's multi-turn OTB written as loops over plain lists (the formula, independently)."""
    b = len(mask)
    toks = [[t for t in range(len(mask[i])) if mask[i][t]] for i in range(b)]
    ret = [[rewards[i]] * len(toks[i]) for i in range(b)]  # outcome reward on the last token, gamma 1
    cum = []
    for i in range(b):
        acc, row = 0.0, []
        for t in toks[i]:
            acc += w[i][t]
            row.append(acc)
        cum.append(row)
    width = max(len(t) for t in toks)
    base = [[0.0] * width for _ in range(b)]
    for g in set(ids):
        rows = [i for i in range(b) if ids[i] == g and toks[i]]
        if len(rows) < 2:
            continue
        for k in range(width):
            num = sum(ret[i][k] * cum[i][k] for i in rows if k < len(toks[i]))
            den = sum(cum[i][k] for i in rows if k < len(toks[i])) + 1e-8
            for i in rows:
                base[i][k] = num / den
        if zero_tail:
            lens = sorted(len(toks[i]) for i in rows)
            longest = [i for i in rows if len(toks[i]) == lens[-1]]
            if len(longest) == 1 and lens[-1] > lens[-2]:
                for k in range(lens[-2], width):
                    base[longest[0]][k] = 0.0
    adv = [[0.0] * len(mask[0]) for _ in range(b)]
    for i in range(b):
        for k, t in enumerate(toks[i]):
            adv[i][t] = ret[i][k] - base[i][k]
    return adv


@pytest.mark.parametrize("zero_tail", [True, False])
def test_tir_optimal_token_baseline_equals_the_formula(zero_tail):
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]
    ).bool()
    ids = [0, 0, 0, 1, 2]
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 6, generator=g)
    spi = torch.rand(5, 6, generator=g) * 0.5
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0])
    cfg = AlgoConfig(otb_handle_zero_tail=zero_tail)
    adv, _ = tir_optimal_token_baseline(
        rewards, mask, cfg, group_ids=torch.tensor(ids), old_logprobs=old, sum_pi_squared=spi
    )
    w = (1 - 2 * old.exp() + spi).tolist()
    ref = _tir_reference(rewards.tolist(), mask.tolist(), ids, w, zero_tail)
    torch.testing.assert_close(adv, torch.tensor(ref), atol=1e-5, rtol=1e-5)
    # a one-sample group keeps its return (row 3), the other rows vary per packed token
    assert adv[3, 1:3].tolist() == [2.0, 2.0]


def test_kl_cov_ranks_valid_tokens_only():
    # equal covariances everywhere: topk picks among valid tokens by verl's order over the compacted list
    lp = torch.zeros(2, 3)
    adv = torch.zeros(2, 3)
    mask = torch.tensor([[False, True, True], [True, False, True]])
    cfg = AlgoConfig(kl_cov_ratio=0.5, kl_cov_coef=1.0)
    old = torch.full((2, 3), -0.1)
    loss, metrics = POLICY_LOSSES["kl_cov"](lp, old, adv, mask, cfg)
    valid = mask.flatten().nonzero(as_tuple=True)[0]
    top = valid[torch.topk(torch.zeros(4), 2).indices]
    expected = torch.zeros(6)
    expected[top] = 0.1  # |log r| = 0.1 on the picked tokens (A = 0)
    torch.testing.assert_close(loss.flatten(), expected)
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)
