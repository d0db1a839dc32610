"""Flow-GRPO math against direct formulas: the schedule, the SDE transition's density, eta -> 0, the loss."""

from __future__ import annotations

import math

import pytest
import torch
from yatt_algos.aggregation import aggregate
from yatt_algos.flow_grpo import (
    flow_grpo_loss,
    gaussian_logprob,
    ode_step,
    sde_mean_std,
    sde_step,
    sigma_schedule,
)
from yatt_algos.kl import kl_penalty
from yatt_algos.policy_losses import ppo_clip
from yatt_algos.types import AlgoConfig


def test_sigma_schedule_is_sd3_time_shift() -> None:
    sig = sigma_schedule(4, 3.0)
    s = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.allclose(sig, 3 * s / (1 + 2 * s))
    assert sig[0] == 1.0 and sig[-1] == 0.0
    assert torch.allclose(sigma_schedule(4, 1.0), s)  # shift 1: evenly spaced
    with pytest.raises(ValueError, match="shift must be > 0"):
        sigma_schedule(4, 0.0)


def test_sde_logprob_equals_direct_gaussian_density() -> None:
    torch.manual_seed(0)
    x, v, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    sigma, nxt, eta, smax = 0.6, 0.45, 0.7, 0.9
    sample, logp = sde_step(x, v, sigma, nxt, eta=eta, sigma_max=smax, noise=noise)
    # the formula written out: std_t = eta sqrt(sigma / (1 - sigma)), dt < 0
    dt = nxt - sigma
    std_t = eta * math.sqrt(sigma / (1 - sigma))
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * math.sqrt(-dt)
    assert torch.allclose(sample, mean + std * noise, atol=1e-6)
    direct = torch.distributions.Normal(mean, std).log_prob(sample).flatten(1).mean(1)
    assert torch.allclose(logp, direct, atol=1e-5)
    # scoring the stored sample gives the same number (the learner's recompute)
    _, again = sde_step(x, v, sigma, nxt, eta=eta, sigma_max=smax, sample=sample)
    assert torch.equal(again, logp)


def test_first_step_uses_sigma_max_for_one_minus_sigma() -> None:
    x, v = torch.zeros(1, 4), torch.ones(1, 4)
    _, std = sde_mean_std(x, v, 1.0, 0.9, 0.5, 0.9)
    assert std == pytest.approx(0.5 * math.sqrt(1.0 / (1 - 0.9)) * math.sqrt(0.1))


def test_eta_to_zero_reproduces_the_ode_sampler() -> None:
    torch.manual_seed(1)
    x, v, noise = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    euler = ode_step(x, v, 0.7, 0.5)
    assert torch.allclose(euler, x - 0.2 * v)
    exact, logp = sde_step(x, v, 0.7, 0.5, eta=0.0, sigma_max=0.9, noise=noise)
    assert torch.equal(exact, euler) and torch.equal(logp, torch.zeros(2))
    gaps = [
        float((sde_step(x, v, 0.7, 0.5, eta=e, sigma_max=0.9, noise=noise)[0] - euler).abs().max())
        for e in (1e-2, 1e-4)
    ]
    assert gaps[1] < gaps[0] / 50 and gaps[1] < 1e-3
    with pytest.raises(ValueError, match="no log-probability"):
        sde_step(x, v, 0.7, 0.5, eta=0.0, sigma_max=0.9, sample=euler)


def test_gaussian_logprob_gradient_flows_to_mean_only() -> None:
    mean = torch.zeros(1, 3, requires_grad=True)
    sample = torch.ones(1, 3, requires_grad=True)
    gaussian_logprob(sample, mean, 2.0).sum().backward()
    assert sample.grad is None  # the stored sample is data
    assert torch.allclose(mean.grad, torch.full((1, 3), 1.0 / 4 / 3))


def test_loss_is_ppo_clip_per_step_plus_kl_aggregated() -> None:
    torch.manual_seed(2)
    logp, old, ref = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    adv = torch.randn(4, 1).expand(4, 3)
    cfg = AlgoConfig(clip_ratio_low=1e-4, clip_ratio_high=1e-4, kl_loss_coef=0.01)
    loss, metrics = flow_grpo_loss(logp, old, adv, cfg, ref_logprobs=ref)
    mask = torch.ones(4, 3, dtype=torch.bool)
    per_step, _ = ppo_clip(logp, old, adv, mask, cfg)
    expected = aggregate(per_step + 0.01 * kl_penalty(logp, ref, "k3"), mask, "token-mean")
    assert torch.allclose(loss, expected)
    assert "clip_frac" in metrics and metrics["kl"] > 0
    # on-policy (ratio 1): the loss is -mean(advantage), the plain policy gradient
    on, _ = flow_grpo_loss(old, old, adv, AlgoConfig())
    assert torch.allclose(on, -adv.mean())
