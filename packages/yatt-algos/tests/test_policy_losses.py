"""Policy losses: hand-worked values, gradients where the clip binds, mismatch correction, bad input."""

import math

import pytest
import torch
from yatt_algos.policy_losses import POLICY_LOSSES, cispo, dual_clip, gspo, ppo_clip
from yatt_algos.types import AlgoConfig

CFG = AlgoConfig()  # clip 0.2 / 0.2, dual-clip c = 3


def _logprobs(ratios, old):
    """logprobs (a leaf with grad) whose ratio to exp(old) is `ratios`."""
    old = torch.tensor([old])
    return (old + torch.log(torch.tensor([ratios]))).requires_grad_(True), old


def test_ppo_clip_hand_worked():
    # r = (1.5, 0.5, 1.1, 0.7), A = (1, 1, -1, -1), clip [0.8, 1.2]:
    #   t0: max(-1.5, -1.2) = -1.2 (clipped, no gradient)   t1: max(-0.5, -0.8) = -0.5
    #   t2: max(1.1, 1.1) = 1.1                              t3: max(0.7, 0.8) = 0.8 (clipped, no gradient)
    lp, old = _logprobs([1.5, 0.5, 1.1, 0.7], [0.0, -1.0, -2.0, -0.5])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = ppo_clip(lp, old, adv, torch.ones(1, 4), CFG)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1, 0.8]]))
    loss.sum().backward()
    # d(-A r)/d logp = -A r where unclipped; exactly 0 where the clip binds on the losing side
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5, 1.1, 0.0]]))
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(0.95)  # (1.5 + 0.5 + 1.1 + 0.7) / 4
    assert (m["ratio_max"].item(), m["ratio_min"].item()) == pytest.approx((1.5, 0.5))
    # approx_kl = mean(r - 1 - log r) = (0.094535 + 0.193147 + 0.004690 + 0.056675) / 4
    assert m["approx_kl"].item() == pytest.approx(0.0872618, abs=1e-6)


def test_clip_higher_is_asymmetric():
    # DAPO: clip_ratio_high 0.6 lets r = 1.5 with A > 0 through (max(-1.5, -1.6) = -1.5), gradient -1.5;
    # the low side is unchanged: r = 0.7, A < 0 still clips at 0.8.
    lp, old = _logprobs([1.5, 0.7], [0.0, 0.0])
    loss, m = ppo_clip(
        lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), AlgoConfig(clip_ratio_high=0.6)
    )
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[-1.5, 0.8]]))
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.5, 0.0]]))
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_dual_clip_caps_negative_advantages():
    # A = -1: r = 4 gives PPO-clip loss max(4, 1.2) = 4, capped at c * |A| = 3 (no gradient);
    # r = 2 gives 2 < 3 (gradient -A r = 2); A = +1 with r = 4 is PPO-clip: max(-4, -1.2) = -1.2.
    lp, old = _logprobs([4.0, 2.0, 4.0], [0.0, 0.0, 0.0])
    loss, m = dual_clip(lp, old, torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3), CFG)
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]]))
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    assert m["clip_frac_lower"].item() == pytest.approx(1 / 3)


def test_gspo_sequence_ratio():
    # log ratios (0.2, -0.1) -> s = exp(mean) = exp(0.05) = 1.0512711; A = 1 on both tokens.
    lp = torch.tensor([[0.2, -0.1]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    loose = AlgoConfig(gspo_clip_ratio_high=0.2)
    loss, m = gspo(lp, old, adv, torch.ones(1, 2), loose)
    loss.sum().backward()
    s = math.exp(0.05)
    torch.testing.assert_close(loss, torch.tensor([[-s, -s]]))
    torch.testing.assert_close(lp.grad, torch.tensor([[-s, -s]]))  # GSPO-token: -A sg(s) d log pi_t
    assert m["seq_ratio_mean"].item() == pytest.approx(s)
    # The paper's clip (4e-4 above 1) binds: the loss is -1.0004 per token and the gradient is zero.
    lp.grad = None
    loss, m = gspo(lp, old, adv, torch.ones(1, 2), CFG)
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004]]))
    torch.testing.assert_close(lp.grad, torch.zeros(1, 2))
    assert m["clip_frac"].item() == 1.0


def test_gspo_ignores_padding_in_the_sequence_ratio():
    lp = torch.tensor([[0.2, -0.1, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = gspo(lp, torch.zeros(1, 3), torch.ones(1, 3), mask, AlgoConfig(gspo_clip_ratio_high=0.2))
    s = math.exp(0.05)
    torch.testing.assert_close(loss, torch.tensor([[-s, -s, 0.0]]))


def test_cispo_hand_worked():
    # r = (1.5, 0.5), A = 1, weight clip [0, 1.28] -> w = (1.28, 0.5)
    # logp = (-1 + log 1.5, -2 + log 0.5) = (-0.594535, -2.693147); loss = -w A logp = (0.761005, 1.346574)
    lp, old = _logprobs([1.5, 0.5], [-1.0, -2.0])
    loss, m = cispo(lp, old, torch.ones(1, 2), torch.ones(1, 2), CFG)
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[0.761005, 1.346574]]))
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, -0.5]]))  # every token keeps a gradient
    assert m["clip_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("level", "mode", "expected", "over"),
    [
        # w = exp(old - rollout) = (3, 1); ppo_clip at r = 1 with A = 1 is -1 per token, times w
        ("token", "truncate", [-2.0, -1.0], 0.5),  # min(3, 2) = 2
        ("token", "mask", [0.0, -1.0], 0.5),  # 3 > 2 -> 0
        ("sequence", "truncate", [-2.0, -2.0], 1.0),  # product 3 * 1 = 3 -> 2 on every token
        ("sequence", "mask", [0.0, 0.0], 1.0),
    ],
)
def test_rollout_mismatch_correction(level, mode, expected, over):
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[math.log(1 / 3), 0.0]])
    cfg = AlgoConfig(rollout_is_level=level, rollout_is_mode=mode, rollout_is_threshold=2.0)
    loss, m = ppo_clip(old.clone(), old, torch.ones(1, 2), torch.ones(1, 2), cfg, rollout_logprobs=rollout)
    torch.testing.assert_close(loss, torch.tensor([expected]))
    assert m["rollout_is_over_frac"].item() == pytest.approx(over)
    # without rollout logprobs, or with the correction off, nothing changes
    plain, _ = ppo_clip(old.clone(), old, torch.ones(1, 2), torch.ones(1, 2), CFG, rollout_logprobs=rollout)
    torch.testing.assert_close(plain, torch.tensor([[-1.0, -1.0]]))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_tokens_give_zero_and_no_nan(name):
    lp = torch.tensor([[-1.0, float("nan"), -50.0]], requires_grad=True)
    old = torch.tensor([[-1.2, 0.0, 30.0]])
    mask = torch.tensor([[1, 0, 0]])
    loss, metrics = POLICY_LOSSES[name](lp, old, torch.ones(1, 3), mask, CFG)
    loss.sum().backward()
    assert loss[0, 1:].tolist() == [0.0, 0.0]
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1:].tolist() == [0.0, 0.0]
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_bad_shapes_name_the_argument(name):
    fn = POLICY_LOSSES[name]
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 2\), expected \(2, 3\) like logprobs"):
        fn(x, x, torch.zeros(2, 2), x, CFG)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(3,\), expected \(2, 3\)"):
        fn(x, x, x, x, CFG, rollout_logprobs=torch.zeros(3))
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        fn(x, x, x, x + 0.5, CFG)
