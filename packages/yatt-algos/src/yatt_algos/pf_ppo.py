"""pf-PPO, policy filtration (Shen et al., "Policy Filtration in RLHF to Fine-Tune LLM for Code Generation",
arXiv 2409.06957): the reward model is least reliable in the middle of its range, so the batch is resampled,
with replacement, by weights that favour samples with extreme (trustworthy) rewards, before the update.

Weights from the B scores, by `AlgoConfig.pf_ppo_method` (verl's `algorithm.pf_ppo.reweight_method`):
- "pow": |s|^pf_ppo_weight_pow,
- "max_min": 1 for the batch's highest and lowest scores, 0 otherwise,
- "max_random": 0.4 for the highest score, 0.1 otherwise,
each plus 1e-8 so every sample stays drawable. `pf_ppo_resample` draws B indices from them; the caller
indexes every [B, ...] tensor of the batch (and its group ids) with them, after computing advantages, as
verl does. Pure given the generator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_algos.types import AlgoConfig


def _pow(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    return scores.abs().pow(weight_pow)


def _max_min(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    extreme = (scores == scores.max()) | (scores == scores.min())
    return extreme.to(scores.dtype)


def _max_random(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    return torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)


# Each: (scores [B], weight_pow) -> unnormalized weights [B]
PF_PPO_WEIGHTS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "pow": _pow,
    "max_min": _max_min,
    "max_random": _max_random,
}


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float = 2.0) -> torch.Tensor:
    """Sampling weights [B] (not normalized, each >= 1e-8) from one score per sample [B]."""
    if method not in PF_PPO_WEIGHTS:
        raise ValueError(f"method {method!r} is not one of {sorted(PF_PPO_WEIGHTS)}")
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"scores must be a non-empty [B] tensor, got shape {tuple(scores.shape)}")
    return PF_PPO_WEIGHTS[method](scores.float(), weight_pow).clamp(min=0.0) + 1e-8


def pf_ppo_resample(
    scores: torch.Tensor, config: AlgoConfig, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """B row indices [B] (int64) drawn with replacement by `pf_ppo_weights`; arange(B) when the method is
    "none" (pf-PPO off), so a caller can always index with the result."""
    if config.pf_ppo_method == "none":
        return torch.arange(scores.shape[0], device=scores.device)
    weights = pf_ppo_weights(scores, config.pf_ppo_method, config.pf_ppo_weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
