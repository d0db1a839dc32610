"""KL estimators and the reward penalty, the adaptive KL coefficient, the clipped value loss, and chunked
logprobs and entropy from logits: hand-worked values, parity with the unchunked formulas, bad input."""

import math

import pytest
import torch
from yatt_algos.kl import KL_ESTIMATORS, adaptive_kl_coef, apply_kl_penalty, kl_penalty
from yatt_algos.value import (
    entropy_from_logits,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    value_loss,
)


def test_kl_estimators_hand_worked():
    # x = log(ref / pi) = -1.5 - (-1.0) = -0.5
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)  # -x
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)  # x^2 / 2
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.1065307)  # e^-0.5 + 0.5 - 1
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(0.5)  # |x|
    assert sorted(KL_ESTIMATORS) == [
        "abs",
        "abs+",
        "k1",
        "k1+",
        "k2",
        "k3",
        "k3+",
        "low_var_kl",
        "low_var_kl+",
    ]


def test_k3_is_clamped_and_nonnegative():
    # x = -30 is clamped to -20: e^-20 + 20 - 1 = 19 -> capped at 10; x = +40 overflows unclamped -> 10
    lp = torch.tensor([[0.0, -40.0, -1.0]])
    ref = torch.tensor([[-30.0, 0.0, -1.0 + 1e-7]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[10.0, 10.0, 0.0]]))
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 64, generator=gen) * 5, torch.randn(64, 64, generator=gen) * 5
    assert (kl_penalty(a, b, "k3") >= 0).all()


def test_apply_kl_penalty_hand_worked():
    # k1 = logp - ref = (0.5, 0, -0.5); rewards - 0.1 * k1 = (-0.05, 0, 1.05)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    lp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    out, mean_kl = apply_kl_penalty(rewards, lp, ref, torch.ones(1, 3), coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.0, 1.05]]))
    assert mean_kl.item() == pytest.approx(0.0)  # (0.5 + 0 - 0.5) / 3
    out, mean_kl = apply_kl_penalty(rewards, lp, ref, torch.tensor([[1, 1, 0]]), coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.0, 0.0]]))
    assert mean_kl.item() == pytest.approx(0.25)  # (0.5 + 0) / 2


def test_adaptive_kl_coef_hand_worked():
    # error = clip(0.15 / 0.1 - 1, -0.2, 0.2) = 0.2: 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    assert adaptive_kl_coef(0.1, 0.15, target=0.1, horizon=10000, num_steps=256) == pytest.approx(0.100512)
    # error = 0.09 / 0.1 - 1 = -0.1: 0.1 * (1 - 0.1 * 256 / 10000) = 0.099744
    assert adaptive_kl_coef(0.1, 0.09, target=0.1, horizon=10000, num_steps=256) == pytest.approx(0.099744)
    with pytest.raises(ValueError, match=r"target must be > 0 and horizon >= 1, got 0\.0, 10"):
        adaptive_kl_coef(0.1, 0.1, target=0.0, horizon=10, num_steps=1)


def test_kl_bad_input():
    with pytest.raises(ValueError, match=r"estimator 'k4' is not one of \['abs', 'abs\+', 'k1', 'k1\+', "):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(1, 3\), expected \(1, 2\)"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3))


def test_value_loss_hand_worked():
    # t0: v_clip = 0.5 + clamp(0.5, +-0.2) = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845, clipped, no grad
    # t1: v_clip = 0.2 + clamp(-0.2) = 0.0; both terms 0 -> 0
    # t2: masked
    values = torch.tensor([[1.0, 0.0, 7.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.2, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    loss, m = value_loss(values, old, returns, torch.tensor([[1, 1, 0]]), clip_range=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.0, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.zeros(1, 3))
    assert m["vf_clip_frac"].item() == pytest.approx(0.5)
    assert m["value_mean"].item() == pytest.approx(0.5)  # (1 + 0) / 2
    # unclipped token: loss 0.5 (v - R)^2 = 0.5 * 0.25, gradient v - R = -0.5
    v = torch.tensor([[1.5]], requires_grad=True)
    loss, _ = value_loss(v, torch.tensor([[1.4]]), torch.tensor([[2.0]]), torch.ones(1, 1), clip_range=0.2)
    loss.sum().backward()
    assert (loss.item(), v.grad.item()) == pytest.approx((0.125, -0.5))
    with pytest.raises(ValueError, match=r"returns has shape \(1, 2\), expected \(1, 1\) like values"):
        value_loss(v, v, torch.zeros(1, 2), torch.ones(1, 1), clip_range=0.2)


def test_logprobs_and_entropy_hand_worked():
    # softmax(0, ln 3) = (0.25, 0.75): log p = (ln 0.25, ln 0.75); entropy of (0.5, 0.25, 0.25) = 1.5 ln 2
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    lp = logprobs_from_logits(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.25), math.log(0.75)]]))
    three = torch.log(torch.tensor([[[0.5, 0.25, 0.25, 0.0]]]))  # the last logit is -inf: p = 0, no NaN
    torch.testing.assert_close(entropy_from_logits(three), torch.tensor([[1.5 * math.log(2.0)]]))


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_chunked_matches_full_softmax_with_gradients(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 37, generator=gen) * 4).requires_grad_(True)
    labels = torch.randint(0, 37, (2, 5), generator=gen)
    lp = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    ent = entropy_from_logits(logits, chunk_size=chunk_size)
    (lp.sum() + 0.3 * ent.sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    log_p = torch.log_softmax(logits, -1)
    ref_lp = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp.detach())
    torch.testing.assert_close(ent, ref_ent.detach())
    torch.testing.assert_close(got, logits.grad)
    # the fused pass gives the same values and gradients
    ref_grad = logits.grad.clone()
    logits.grad = None
    both_lp, both_ent = logprobs_and_entropy_from_logits(logits, labels, chunk_size=chunk_size)
    (both_lp.sum() + 0.3 * both_ent.sum()).backward()
    torch.testing.assert_close(both_lp, ref_lp.detach())
    torch.testing.assert_close(both_ent, ref_ent.detach())
    torch.testing.assert_close(logits.grad, ref_grad)


def test_masked_vocabulary_gives_finite_entropy_and_gradient():
    # logits (0, 0, -inf): p = (0.5, 0.5, 0) -> H = ln 2; d H / d logit is finite (0 on the -inf entry)
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    lp, ent = logprobs_and_entropy_from_logits(logits, torch.tensor([[1]]))
    (ent.sum() + lp.sum()).backward()
    assert ent.item() == pytest.approx(math.log(2.0)) and lp.item() == pytest.approx(math.log(0.5))
    assert torch.isfinite(logits.grad).all()
    assert entropy_from_logits(logits.detach()).item() == pytest.approx(math.log(2.0))


def test_bf16_logits_give_fp32_results():
    logits = torch.randn(1, 4, 50).to(torch.bfloat16)
    out = logprobs_from_logits(logits, torch.zeros(1, 4, dtype=torch.long))
    assert out.dtype == torch.float32 and entropy_from_logits(logits).dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1)[..., 0]
    torch.testing.assert_close(out, ref)


def test_logits_bad_input():
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\], got shape \(2, 3\)"):
        entropy_from_logits(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"labels has shape \(2, 2\), expected \(2, 3\)"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be an integer tensor, got torch\.float32"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        entropy_from_logits(torch.zeros(2, 3, 4), chunk_size=0)
