"""Offline preference losses on sequence log-probabilities: DPO (sigmoid), IPO and hinge (SLiC), with label
smoothing, as pure functions of [B] tensors.

DPO: Rafailov et al. 2023, "Direct Preference Optimization" (arXiv 2305.18290), eq. 7. cDPO label smoothing:
Mitchell 2023, "A note on DPO with noisy preferences". IPO: Azar et al. 2023, "A General Theoretical Paradigm
to Understand Learning from Human Preferences" (arXiv 2310.12036), eq. 17. Hinge: Zhao et al. 2023, SLiC-HF
(arXiv 2305.10425), as TRL's `DPOTrainer` writes it. `LOSS_TYPES` names them as TRL does.

Every input is a sequence log-probability: the sum over the response's tokens of log pi(token | prefix), as in
the DPO paper. IPO's authors (and TRL) average over tokens instead; here the caller decides what it passes, and
`yatt dpo` passes sums for all three (one convention per run, as issue 28 asks). Departures from TRL: label
smoothing eps is the probability that a preference label is flipped, applied to every loss type as
(1 - eps) * L(h) + eps * L(-h); for `sigmoid` that is exactly cDPO (TRL's formula), for `hinge` and `ipo` TRL
ignores `label_smoothing` and so do these at eps = 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["LOSS_TYPES", "dpo_loss", "preference_sums"]


def _sigmoid(h: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO: -log sigma(beta * h)."""
    return -F.logsigmoid(beta * h)


def _hinge(h: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC hinge: max(0, 1 - beta * h)."""
    return torch.relu(1.0 - beta * h)


def _ipo(h: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO: (h - 1 / (2 beta))^2, beta playing the paper's tau (the regularization strength)."""
    return (h - 1.0 / (2.0 * beta)) ** 2


# loss type -> per-pair loss of h = (pc - rc) - (pr - rr) at a given beta
LOSS_TYPES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [B] and the implicit rewards of the chosen and rejected responses [B].

    Inputs are sequence log-probabilities [B] (summed over response tokens) of the policy and of the frozen
    reference. With h = (pc - rc) - (pr - rr), the log-ratio margin:
      sigmoid: -log sigma(beta h) (DPO), hinge: relu(1 - beta h), ipo: (h - 1/(2 beta))^2,
    each mixed with its flipped-label twin: (1 - eps) L(h) + eps L(-h), eps = `label_smoothing` in [0, 0.5).
    Rewards: beta (pc - rc) and beta (pr - rr), detached (metrics: their difference is the margin, and
    `chosen > rejected` the preference accuracy, a tie counting half)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {sorted(LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    shapes = {
        tuple(t.shape)
        for t in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    }
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(
            f"dpo_loss takes four [B] tensors of sequence log-probs, got shapes {sorted(shapes)}"
        )
    chosen = policy_chosen_logps - ref_chosen_logps  # [B] log pi/pi_ref of the chosen response
    rejected = policy_rejected_logps - ref_rejected_logps  # [B]
    h = chosen - rejected
    loss = LOSS_TYPES[loss_type]
    losses = loss(h, beta)
    if label_smoothing:
        losses = (1.0 - label_smoothing) * losses + label_smoothing * loss(-h, beta)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def preference_sums(
    losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
) -> dict[str, float]:
    """Sums over the pairs (for means after an all-reduce over ranks and controllers): `pairs`, `loss`,
    `rewards_chosen`, `rewards_rejected`, `margin` and `correct`: the pairs whose chosen reward is above the
    rejected one, a tie counting 0.5 (chance: TRL counts a tie wrong, which puts the reference itself at 0)."""
    return {
        "pairs": float(losses.numel()),
        "loss": float(losses.detach().sum()),
        "rewards_chosen": float(chosen_rewards.sum()),
        "rewards_rejected": float(rejected_rewards.sum()),
        "margin": float((chosen_rewards - rejected_rewards).sum()),
        "correct": float(
            (chosen_rewards > rejected_rewards).sum() + 0.5 * (chosen_rewards == rejected_rewards).sum()
        ),
    }
