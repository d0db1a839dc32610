"""The policy losses ported from verl (GMPO, GPG, REINFORCE, SAPO, Clip-Cov, KL-Cov, DPPO-TV/KL): hand-worked
values and gradients (the working is in the comments)."""

import math

import pytest
import torch
from yatt_algos.aggregation import aggregate
from yatt_algos.policy_losses import (
    POLICY_LOSSES,
    clip_cov,
    dppo_kl,
    dppo_tv,
    gmpo,
    gpg,
    kl_cov,
    reinforce,
    sapo,
)
from yatt_algos.types import AlgoConfig

CFG = AlgoConfig()


def _leaf(values) -> torch.Tensor:
    return torch.tensor([values]).requires_grad_(True)


def test_gmpo_clips_in_log_space_by_advantage_sign():
    # both rows: ratios (1.5, 0.5), log r = (0.405465, -0.693147), clip [-0.2, 0.2] in log space.
    # A = +1: l' = min(l, clip(l)) = (0.2, -0.693147): mean -0.246574, s = 0.781504, loss -0.781504 per token;
    #   d/dlp = -A s / 2 on the unclipped token 1 only: (0, -0.390752)
    # A = -1: l' = max(l, clip(l)) = (0.405465, -0.2): mean 0.102733, s = 1.108195, loss +1.108195;
    #   d/dlp = -A s / 2 on the unclipped token 0 only: (0.554097, 0)
    old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    lp = (old + torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = gmpo(lp, old, adv, torch.ones(2, 2), CFG)
    s_pos, s_neg = math.exp((0.2 + math.log(0.5)) / 2), math.exp((math.log(1.5) - 0.2) / 2)
    torch.testing.assert_close(loss, torch.tensor([[-s_pos, -s_pos], [s_neg, s_neg]]))
    loss.sum().backward()  # each token carries its sequence's loss: the sum is 2 * loss_i per row
    torch.testing.assert_close(lp.grad, 2 * torch.tensor([[0.0, -s_pos / 2], [s_neg / 2, 0.0]]))
    # verl's aggregation of geo_mean is the mean over sequences: seq-mean-token-mean
    agg = aggregate(loss, torch.ones(2, 2), "seq-mean-token-mean")
    assert agg.item() == pytest.approx((-s_pos + s_neg) / 2)
    # as verl counts them: log ratios outside the range, by the sign of A (both tokens of each row)
    assert (m["clip_frac"].item(), m["clip_frac_lower"].item()) == (0.5, 0.5)


def test_reinforce_and_gpg_are_minus_advantage_logprob():
    # loss = -A log pi: (-2 * -0.5, 1 * -1.0) = (1.0, -1.0); gradient -A = (-2, 1); pi_old does not matter
    lp = _leaf([-0.5, -1.0])
    for fn in (reinforce, gpg):
        lp.grad = None
        loss, m = fn(lp, torch.tensor([[-3.0, 0.0]]), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), CFG)
        torch.testing.assert_close(loss, torch.tensor([[1.0, -1.0]]))
        loss.sum().backward()
        torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, 1.0]]))
        assert m["clip_frac"].item() == 0.0


def test_sapo_soft_gate():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau; loss = -f(r) A; d loss / d lp = -A f'(r) r,
    # f'(r) = 4 sigmoid (1 - sigmoid). Tokens: r = 1.2 with A = 1 (tau 1), r = 0.8 with A = -1 (tau 1.05),
    # r = 1 with A = 2 (gradient -A, exactly PPO's at r = 1).
    r = [1.2, 0.8, 1.0]
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    lp = torch.log(torch.tensor([r])).requires_grad_(True)
    loss, m = sapo(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), CFG)
    sig = [1 / (1 + math.exp(-t * (x - 1))) for t, x in zip((1.0, 1.05, 1.0), r, strict=True)]
    f = [s * 4 / t for s, t in zip(sig, (1.0, 1.05, 1.0), strict=True)]
    torch.testing.assert_close(loss, torch.tensor([[-f[0], f[1], -2 * f[2]]]))
    loss.sum().backward()
    grads = [-a * 4 * s * (1 - s) * x for a, s, x in zip((1.0, -1.0, 2.0), sig, r, strict=True)]
    torch.testing.assert_close(lp.grad, torch.tensor([grads]))
    assert lp.grad[0, 2].item() == pytest.approx(-2.0)
    assert m["gate_mean"].item() == pytest.approx(sum(f) / 3)


def test_clip_cov_cuts_high_covariance_tokens():
    # log pi = (0, -2, -1, -3), mean -1.5; A = (2, 2, -2, -2), mean 0: cov = (3, -1, -1, 3).
    # Window (1, 5): tokens 0 and 3; budget max(1, int(0.5 * 4)) = 2 -> both cut (loss and gradient 0).
    # Ratios are 1 (no PPO clip): loss elsewhere -A = (-2, 2).
    lp = _leaf([0.0, -2.0, -1.0, -3.0])
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]])
    cfg = AlgoConfig(policy_loss="clip_cov", clip_cov_ratio=0.5)
    loss, m = clip_cov(lp, lp.detach(), adv, torch.ones(1, 4), cfg)
    torch.testing.assert_close(loss, torch.tensor([[0.0, -2.0, 2.0, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -2.0, 2.0, 0.0]]))
    assert m["clip_frac"].item() == 0.5
    # budget 1: one of the two candidates is cut, the same one on every call
    cut = [
        (clip_cov(lp, lp.detach(), adv, torch.ones(1, 4), AlgoConfig(clip_cov_ratio=0.25))[0] == 0)[
            0
        ].tolist()
        for _ in range(2)
    ]
    assert cut[0] == cut[1] and cut[0] in ([True, False, False, False], [False, False, False, True])
    # token 0 already clipped by PPO (r = 1.5, A > 0) is not a candidate: only token 3 is cut
    old = lp.detach() - torch.log(torch.tensor([[1.5, 1.0, 1.0, 1.0]]))
    loss, m = clip_cov(lp, old, adv, torch.ones(1, 4), cfg)
    torch.testing.assert_close(loss, torch.tensor([[-2.4, -2.0, 2.0, 0.0]]))  # -A clip(1.5) = -2 * 1.2
    assert (m["clip_frac"].item(), m["ppo_clip_frac"].item()) == (0.25, 0.25)


def test_kl_cov_penalizes_the_top_covariance_token():
    # log pi = (0, -2, -1, -3), mean -1.5; A = (2, 2, -2, -3), mean -0.25:
    # cov = (2.25 * 1.5, 2.25 * -0.5, -1.75 * 0.5, -2.75 * -1.5) = (3.375, -1.125, -0.875, 4.125)
    # k = max(1, int(4 * 0.25)) = 1 -> token 3. r = (1, 1, 1, 1.2): loss = -A r = (-2, -2, 2, 3.6),
    # plus 0.1 * |log 1.2| on token 3; its gradient -A r + 0.1 = 3.7
    lp = _leaf([0.0, -2.0, -1.0, -3.0])
    old = lp.detach() - torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.2]]))
    adv = torch.tensor([[2.0, 2.0, -2.0, -3.0]])
    loss, m = kl_cov(lp, old, adv, torch.ones(1, 4), AlgoConfig(kl_cov_ratio=0.25, kl_cov_coef=0.1))
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.0, 2.0, 3.6 + 0.1 * math.log(1.2)]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, -2.0, 2.0, 3.7]]))
    assert m["clip_frac"].item() == 0.25


def test_dppo_tv_trust_region_on_probability_change():
    # p_old = 0.5; p = (0.7, 0.6, 0.3, 0.4); A = (1, 1, -1, -1); thresholds 0.15:
    # token 0 rises 0.2 > 0.15 with A > 0 -> out; token 1 rises 0.1 -> in; token 2 falls 0.2 with A < 0 -> out;
    # token 3 falls 0.1 -> in. In: loss -A sg(r) log p: 1.2 * -log 0.6 ... = (0, 0.612991, 0, -0.733033);
    # gradient -A r = (0, -1.2, 0, 0.8)
    p = torch.tensor([[0.7, 0.6, 0.3, 0.4]])
    lp = p.log().requires_grad_(True)
    old = torch.full((1, 4), math.log(0.5))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = dppo_tv(lp, old, adv, torch.ones(1, 4), CFG)
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.2 * math.log(0.6), 0.0, 0.8 * math.log(0.4)]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.2, 0.0, 0.8]]))
    assert (m["clip_frac"].item(), m["is_cap_frac"].item()) == (0.5, 0.0)
    # the IS cap: r = 1.2 on token 1 is truncated to 1.1
    loss, m = dppo_tv(lp, old, adv, torch.ones(1, 4), AlgoConfig(dppo_is_cap=1.1))
    assert loss[0, 1].item() == pytest.approx(-1.1 * math.log(0.6)) and m["is_cap_frac"].item() == 0.25


def test_dppo_kl_trust_region_on_binary_kl():
    # p_old = 0.5. KL(0.5 || 0.7) = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.087177 > 0.05;
    # KL(0.5 || 0.55) = 0.005025. A = (1, 1, -1, 1, -1), p = (0.7, 0.55, 0.7, 0.3, 0.3):
    # t0 A > 0 rising too far -> out; t1 small -> in; t2 A < 0 but p rose (not pushed down) -> in;
    # t3 A > 0 but p fell -> in; t4 A < 0 falling too far (KL 0.087) -> out.
    p = torch.tensor([[0.7, 0.55, 0.7, 0.3, 0.3]])
    lp = p.log().requires_grad_(True)
    old = torch.full((1, 5), math.log(0.5))
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, -1.0]])
    loss, m = dppo_kl(lp, old, adv, torch.ones(1, 5), CFG)
    r = p / 0.5
    want = torch.where(torch.tensor([[False, True, True, True, False]]), -adv * r * p.log(), 0.0)
    torch.testing.assert_close(loss, want)
    assert m["clip_frac"].item() == pytest.approx(0.4)


def test_every_new_loss_is_registered():
    new = ("gmpo", "gpg", "sapo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "reinforce")
    assert all(POLICY_LOSSES[name].__name__ == name for name in new)
