"""DPO, IPO and hinge losses on hand-worked pairs (values and gradients, with and without label smoothing),
parity with the DPO paper's formula on a random batch, the implicit rewards and metric sums, bad input."""

import math

import pytest
import torch
from yatt_algos.dpo import LOSS_TYPES, dpo_loss, preference_sums


def _pair(beta: float, loss_type: str, eps: float) -> tuple[float, float, float, float, float]:
    """(loss, d/d pc, d/d pr, chosen reward, rejected reward) of the pair pc=-1, pr=-2, rc=rr=-1.5: the
    log-ratios are +0.5 (chosen) and -0.5 (rejected), so h = 1."""
    pc, pr = torch.tensor([-1.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    ref = torch.tensor([-1.5])
    losses, chosen, rejected = dpo_loss(pc, pr, ref, ref, beta=beta, loss_type=loss_type, label_smoothing=eps)
    losses.sum().backward()
    assert pc.grad is not None and pr.grad is not None
    return float(losses.detach()), float(pc.grad), float(pr.grad), float(chosen), float(rejected)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize(
    ("loss_type", "beta", "eps", "loss", "grad"),
    [
        # sigmoid, beta h = 0.5: -log sig(0.5); d/dh = -beta sig(-0.5)
        ("sigmoid", 0.5, 0.0, math.log1p(math.exp(-0.5)), -0.5 * _sig(-0.5)),
        # cDPO: 0.8 (-log sig(0.5)) + 0.2 (-log sig(-0.5)); d/dh = 0.8 (-beta sig(-0.5)) + 0.2 beta sig(0.5)
        (
            "sigmoid",
            0.5,
            0.2,
            0.8 * math.log1p(math.exp(-0.5)) + 0.2 * math.log1p(math.exp(0.5)),
            -0.8 * 0.5 * _sig(-0.5) + 0.2 * 0.5 * _sig(0.5),
        ),
        # hinge: relu(1 - 0.5) = 0.5, slope -beta; flipped twin relu(1 + 0.5) = 1.5, slope +beta
        ("hinge", 0.5, 0.0, 0.5, -0.5),
        ("hinge", 0.5, 0.2, 0.8 * 0.5 + 0.2 * 1.5, 0.8 * -0.5 + 0.2 * 0.5),
        # ipo, beta 0.25: 1/(2 beta) = 2: (1 - 2)^2 = 1, slope 2 (h - 2) = -2; twin (-1 - 2)^2 = 9, slope 2 (h + 2) = 6
        ("ipo", 0.25, 0.0, 1.0, -2.0),
        ("ipo", 0.25, 0.2, 0.8 * 1.0 + 0.2 * 9.0, 0.8 * -2.0 + 0.2 * 6.0),
    ],
)
def test_hand_worked_pair(loss_type, beta, eps, loss, grad):
    value, d_chosen, d_rejected, chosen, rejected = _pair(beta, loss_type, eps)
    assert value == pytest.approx(loss, abs=1e-6)
    assert d_chosen == pytest.approx(grad, abs=1e-6)  # dh/dpc = 1
    assert d_rejected == pytest.approx(-grad, abs=1e-6)  # dh/dpr = -1
    assert (chosen, rejected) == pytest.approx((beta * 0.5, beta * -0.5))


def test_sigmoid_matches_the_dpo_paper_formula_on_a_batch():
    """Eq. 7 of Rafailov et al.: -log sig(beta log(pi_c / ref_c) - beta log(pi_r / ref_r)), per pair, with
    the same gradient."""
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-10 * torch.rand(8, generator=gen) for _ in range(4))
    pc.requires_grad_(True)
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.3)
    (grad,) = torch.autograd.grad(losses.sum(), pc)
    x = pc.detach().clone().requires_grad_(True)
    paper = -torch.log(torch.sigmoid(0.3 * (x - rc) - 0.3 * (pr - rr)))
    (expected,) = torch.autograd.grad(paper.sum(), x)
    torch.testing.assert_close(losses, paper, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6)
    assert not chosen.requires_grad and not rejected.requires_grad


def test_equal_policy_and_reference_give_log2_zero_rewards_and_chance_accuracy():
    """At the first step the policy is the reference: h = 0, loss log 2, rewards 0, every pair a tie counted
    half (accuracy 0.5, chance; TRL's strict > would say 0)."""
    logps = torch.tensor([-3.0, -7.0])
    losses, chosen, rejected = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1)
    torch.testing.assert_close(losses, torch.full((2,), math.log(2.0)))
    sums = preference_sums(losses, chosen, rejected)
    assert sums == pytest.approx(
        {
            "pairs": 2.0,
            "loss": 2 * math.log(2.0),
            "rewards_chosen": 0.0,
            "rewards_rejected": 0.0,
            "margin": 0.0,
            "correct": 1.0,
        }
    )


def test_preference_sums_count_pairs_where_chosen_wins_and_ties_as_half():
    """One win, one loss, one tie: correct = 1 + 0.5."""
    losses = torch.tensor([0.1, 0.2, 0.3])
    chosen, rejected = torch.tensor([1.0, -1.0, 0.5]), torch.tensor([0.0, 0.0, 0.5])
    sums = preference_sums(losses, chosen, rejected)
    assert (
        sums["correct"] == 1.5 and sums["margin"] == pytest.approx(0.0) and sums["loss"] == pytest.approx(0.6)
    )


def test_bad_input_is_refused():
    one = torch.zeros(2)
    with pytest.raises(ValueError, match=r"loss_type 'kto' is not one of \['hinge', 'ipo', 'sigmoid'\]"):
        dpo_loss(one, one, one, one, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0, got 0"):
        dpo_loss(one, one, one, one, beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\), got 0.5"):
        dpo_loss(one, one, one, one, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="four \\[B\\] tensors"):
        dpo_loss(torch.zeros(2, 3), one, one, one, beta=0.1)
    assert sorted(LOSS_TYPES) == ["hinge", "ipo", "sigmoid"]
