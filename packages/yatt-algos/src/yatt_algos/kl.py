"""KL divergence estimators between the policy and a reference, per token, after Schulman's "Approximating
KL Divergence" (2020): with x = log(ref / pi) at tokens sampled from pi,

- k1 = -x (unbiased, high variance, can be negative),
- k2 = x^2 / 2 (biased, low variance, >= 0),
- k3 = exp(x) - x - 1 (unbiased, low variance, >= 0); verl calls it low_var_kl,
- abs = |x| (verl's "abs"; not an unbiased KL estimate, a distance penalty).

Straight-through variants ("k1+", "k3+", "abs+", and verl's "low_var_kl+" = "k3+") keep the named estimate's
value but take k2's gradient: d k2 / d theta = log(pi / ref) * grad log pi, whose expectation under pi is the
gradient of the true KL(pi || ref), while the gradients of k1 and k3 are biased (k1's has expectation 0).
This is verl's `kl_penalty(..., "k3+")`; the argument is in Schulman's note above.

k3 is clamped as verl and OpenRLHF do: the log ratio to [-20, 20] so exp never overflows, the estimate to
[0, 10] so one stray token cannot dominate a batch (a departure from the unbiased estimator, bounded).

Use as a loss term (`kl_penalty` then `aggregation.aggregate`), or as a reward penalty with a fixed or
adaptive coefficient (`apply_kl_penalty`, `adaptive_kl_coef`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_algos.checks import as_bool_mask, check_same_shape

_LOG_RATIO_CLAMP = 20.0
_K3_MAX = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log(pi / ref) per token. [B, T] -> [B, T]"""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(log(pi / ref))^2 / 2 per token. [B, T] -> [B, T]"""
    return 0.5 * (logprobs - ref_logprobs).square()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(x) - x - 1 with x = log(ref / pi), clamped to [0, 10]. [B, T] -> [B, T]"""
    x = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.expm1(x) - x).clamp(0.0, _K3_MAX)  # expm1 keeps small x accurate (no cancellation)


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|log(pi / ref)| per token (verl's "abs"). [B, T] -> [B, T]"""
    return (logprobs - ref_logprobs).abs()


def straight_through(
    estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The estimator's value with k2's gradient: k2 - sg(k2) + sg(estimate). [B, T] -> [B, T]"""

    def plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        backward = k2(logprobs, ref_logprobs)
        return backward - backward.detach() + estimator(logprobs, ref_logprobs).detach()

    plus.__name__ = f"{estimator.__name__}_plus"
    plus.__doc__ = f"{estimator.__name__}'s value, k2's gradient (straight-through). [B, T] -> [B, T]"
    return plus


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "abs": kl_abs,
    "k1+": straight_through(k1),
    "k3+": straight_through(k3),
    "abs+": straight_through(kl_abs),
    "low_var_kl": k3,
    "low_var_kl+": straight_through(k3),
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate [B, T] from logprobs [B, T] and ref_logprobs [B, T], by name."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator {estimator!r} is not one of {sorted(KL_ESTIMATORS)}")
    check_same_shape("logprobs", {"logprobs": logprobs, "ref_logprobs": ref_logprobs})
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty (InstructGPT, arXiv 2203.02155): r_t - coef * kl_t on response tokens.

    All [B, T]. Returns the penalized rewards [B, T] (zero where masked) and the batch's mean KL per token
    (a scalar, what `adaptive_kl_coef` tracks). k1 is the default here, as in PPO-RLHF practice.
    Departure: verl's controller tracks the mean over sequences of each sequence's token-mean KL; this is the
    token mean over the batch (the two agree when all responses have one length).
    """
    check_same_shape(
        "token_rewards",
        {
            "token_rewards": token_rewards,
            "logprobs": logprobs,
            "ref_logprobs": ref_logprobs,
            "response_mask": response_mask,
        },
    )
    mask = as_bool_mask("response_mask", response_mask)
    kl = torch.where(mask, kl_penalty(logprobs, ref_logprobs, estimator), 0.0)
    rewards = torch.where(mask, token_rewards - coef * kl, 0.0)
    mean_kl = kl.sum() / mask.sum().clamp(min=1)
    return rewards, mean_kl


def adaptive_kl_coef(coef: float, current_kl: float, *, target: float, horizon: int, num_steps: int) -> float:
    """The adaptive KL controller of Ziegler et al. (arXiv 1909.08593): proportional control toward `target`.

    error = clip(current_kl / target - 1, -0.2, 0.2); coef <- coef * (1 + error * num_steps / horizon).
    num_steps is the number of samples (or steps) since the last update, as in the paper.
    """
    if target <= 0 or horizon < 1:
        raise ValueError(f"target must be > 0 and horizon >= 1, got {target}, {horizon}")
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_steps / horizon)


class FixedKLController:
    """A constant KL-in-reward coefficient (verl's `FixedKLController`): `value` never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the fixed controller ignores the measured KL (scalar) and the step count."""


class AdaptiveKLController:
    """PPO's adaptive KL controller (Ziegler et al. 2019; verl's `AdaptiveKLController`): after each batch,
    value <- value * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon < 1:
            raise ValueError(f"target_kl must be > 0 and horizon >= 1, got {target_kl}, {horizon}")
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """One control step from the batch's mean KL (scalar) over `n_steps` samples (or steps)."""
        self.value = adaptive_kl_coef(
            self.value, current_kl, target=self.target, horizon=self.horizon, num_steps=n_steps
        )


def kl_controller(
    kind: str, kl_coef: float, *, target_kl: float = 0.0, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """verl's `get_kl_controller`: "fixed" or "adaptive" (horizon must be >= 1, target_kl > 0)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"KL controller must be 'fixed' or 'adaptive', got {kind!r}")
