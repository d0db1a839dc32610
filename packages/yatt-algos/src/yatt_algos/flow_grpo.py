"""Flow-GRPO math: the flow-matching ODE sampler turned into an SDE whose every denoising step is a Gaussian
transition with an exact log-probability, and the clipped GRPO loss over those steps.

Flow-GRPO: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470),
eq. 9-12 and its reference code (`sd3_sde_with_logprob.py`); DanceGRPO (arXiv 2505.07818) uses the same
transition. Rectified flow convention (SD3, Flux): x_sigma = (1 - sigma) x0 + sigma noise, the transformer
predicts the velocity v = noise - x0, sigma runs from 1 (noise) to 0 (data), and the ODE (Euler) step is
x' = x + (sigma' - sigma) v.

The SDE step with noise level eta (dt = sigma' - sigma < 0; std_t = eta sqrt(sigma / (1 - sigma))):

    mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    x'   = mean + std_t sqrt(-dt) noise

so x' ~ N(mean, (std_t sqrt(-dt))^2) elementwise, and eta -> 0 gives the Euler step exactly. As the reference
code, std_t at sigma = 1 uses the first step's sigma' in the denominator (1 - 1 = 0 would be infinite), and the
log-probability of a step is the elementwise Gaussian log-density averaged over the latent's elements (a
per-image mean, as Flow-GRPO: the ratio of two such means is what the clip of 1e-4 is sized for).

Each image's trained steps play the role of an LLM sample's tokens: log-probs, ratios and advantages are
[B, K] over K trained steps, and the existing `policy_losses`, `kl` and `aggregation` registries apply as is.
"""

from __future__ import annotations

import math

import torch

from yatt_algos.aggregation import aggregate
from yatt_algos.kl import kl_penalty
from yatt_algos.policy_losses import POLICY_LOSSES
from yatt_algos.types import AlgoConfig

__all__ = ["flow_grpo_loss", "gaussian_logprob", "ode_step", "sde_mean_std", "sde_step", "sigma_schedule"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """The num_steps + 1 noise levels [num_steps + 1] from 1 to 0, time-shifted as SD3's scheduler
    (`FlowMatchEulerDiscreteScheduler(shift=...)`): sigma' = shift s / (1 + (shift - 1) s) for s evenly
    spaced; shift > 1 spends more steps at high noise."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()


def ode_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """The deterministic Euler step of the flow ODE: x + (sigma' - sigma) v (the eta = 0 sampler)."""
    return latents + (sigma_next - sigma) * velocity


def sde_mean_std(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float,
    sigma_next: float,
    eta: float,
    sigma_max: float,
) -> tuple[torch.Tensor, float]:
    """(mean [B, ...], std) of the SDE transition from `latents` at `sigma` to `sigma_next` (module doc).
    `sigma_max` stands in for sigma in 1 - sigma when sigma is 1 (the schedule's second value)."""
    if eta == 0.0:
        return ode_step(latents, velocity, sigma, sigma_next), 0.0
    dt = sigma_next - sigma
    std_t = eta * math.sqrt(sigma / (1 - (sigma_max if sigma >= 1.0 else sigma)))
    mean = (
        latents * (1 + std_t**2 / (2 * sigma) * dt)
        + velocity * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return mean, std_t * math.sqrt(-dt)


def gaussian_logprob(sample: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """log N(sample; mean, std^2), elementwise, averaged over every dim but the first: [B]."""
    logp = -((sample.detach() - mean) ** 2) / (2 * std**2) - math.log(std) - _HALF_LOG_2PI
    return logp.flatten(1).mean(dim=1)


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float,
    sigma_next: float,
    *,
    eta: float,
    sigma_max: float,
    noise: torch.Tensor | None = None,
    sample: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One denoising step: (next latents [B, ...], log-prob of that transition [B]). Draws the next latents
    with `noise` (standard normal, latents' shape), or scores a given `sample` (the learner's recompute).
    eta 0 is the ODE step, with log-prob 0 (a point mass: nothing to train)."""
    mean, std = sde_mean_std(latents, velocity, sigma, sigma_next, eta, sigma_max)
    if sample is None:
        if std == 0.0:
            return mean, torch.zeros(len(latents), dtype=latents.dtype, device=latents.device)
        assert noise is not None, "sde_step draws with noise or scores a sample"
        sample = mean + std * noise
    if std == 0.0:
        raise ValueError(
            "eta = 0 is the deterministic ODE sampler: its steps have no log-probability to train"
        )
    return sample, gaussian_logprob(sample, mean, std)


def flow_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    config: AlgoConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    num_steps: float | None = None,
    num_images: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO objective over denoising steps, all inputs [B, K] (K trained steps of B images; the
    image's advantage repeated on each step): `POLICY_LOSSES[config.policy_loss]` per step, plus
    `config.kl_loss_coef` x the KL estimate `config.kl_estimator` to the reference, aggregated by
    `config.loss_agg_mode` with the global counts `num_steps` (steps of the whole batch) and `num_images`
    when the caller accumulates micro-batches (`max_len`: Dr.GRPO's constant, default
    `config.loss_agg_max_len` or K). Returns (scalar loss, detached metrics)."""
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    per_step, metrics = POLICY_LOSSES[config.policy_loss](logprobs, old_logprobs, advantages, mask, config)
    if ref_logprobs is not None and config.kl_loss_coef:
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_estimator)
        per_step = per_step + config.kl_loss_coef * kl
        metrics["kl"] = kl.detach().mean()
    loss = aggregate(
        per_step,
        mask,
        config.loss_agg_mode,
        num_tokens=num_steps,
        num_seqs=num_images,
        max_len=max_len or config.loss_agg_max_len or None,
    )
    return loss, {k: v.detach() for k, v in metrics.items()}
