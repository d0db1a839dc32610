"""Bone Soup (arXiv 2502.10762): merge backbone policies, each trained on a mix of n rewards, into a model for
a user's preference over the n objectives.

Backbone k is trained on h_k = sum_j B_kj r_j with B the symmetric circulant backbone-reward matrix
(`backbone_matrix`). For a preference mu on the simplex, the coefficients solve B^T lambda = mu
(`merge_coefficients`), so the merged reward sum_k lambda_k h_k equals sum_j mu_j r_j; they sum to 1 and may
be negative (extrapolation). `merge_state_dicts` forms sum_k lambda_k theta_k in fp32; `bone_soup_merge` adds
the optional extrapolation of each backbone away from the SFT model, theta_0 + (theta_k - theta_0) / (1 - a).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def backbone_matrix(num_objectives: int, beta: float) -> torch.Tensor:
    """B(n, beta) [n, n] float64: beta on the diagonal, (1 - beta) / (n - 1) elsewhere; rows sum to 1.

    Its eigenvalues are 1 and beta - (1 - beta) / (n - 1), so beta = 1 / n is singular and refused.
    """
    if num_objectives < 2:
        raise ValueError(f"num_objectives must be >= 2, got {num_objectives}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if abs(beta - 1.0 / num_objectives) < 1e-9:
        raise ValueError(
            f"beta = 1/{num_objectives} makes B singular: every backbone would get the same reward"
        )
    off = (1.0 - beta) / (num_objectives - 1)
    matrix = torch.full((num_objectives, num_objectives), off, dtype=torch.float64)
    return matrix.fill_diagonal_(beta)


def merge_coefficients(matrix: torch.Tensor, preference: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """lambda [n] solving B^T lambda = mu, for B [n, n] and a preference mu [n] on the simplex."""
    mu = torch.as_tensor(preference, dtype=torch.float64)
    n = matrix.shape[0]
    if matrix.dim() != 2 or matrix.shape != (n, n):
        raise ValueError(f"matrix must be square [n, n], got shape {tuple(matrix.shape)}")
    if mu.shape != (n,):
        raise ValueError(f"preference must have {n} entries, got shape {tuple(mu.shape)}")
    if bool((mu < 0).any()) or abs(float(mu.sum()) - 1.0) > 1e-6:
        raise ValueError(f"preference must be on the simplex (>= 0, sum 1), got {mu.tolist()}")
    return torch.linalg.solve(matrix.double().T, mu)


def merge_state_dicts(
    state_dicts: Sequence[Mapping[str, torch.Tensor]], coefficients: Sequence[float] | torch.Tensor
) -> dict[str, torch.Tensor]:
    """sum_k c_k theta_k per floating-point tensor, accumulated in fp32 (fp64 stays fp64) and cast back to
    the tensor's dtype; negative coefficients are allowed. Non-float tensors (integer buffers) must be equal
    in every state dict and are copied."""
    coefs = [float(c) for c in torch.as_tensor(coefficients, dtype=torch.float64).tolist()]
    if len(state_dicts) == 0:
        raise ValueError("state_dicts is empty")
    if len(coefs) != len(state_dicts):
        raise ValueError(f"coefficients has {len(coefs)} entries for {len(state_dicts)} state dicts")
    names = list(state_dicts[0])
    for k, sd in enumerate(state_dicts[1:], start=1):
        if set(sd) != set(names):
            missing, extra = sorted(set(names) - set(sd))[:5], sorted(set(sd) - set(names))[:5]
            raise ValueError(
                f"state_dicts[{k}] keys differ from state_dicts[0]: missing {missing}, extra {extra}"
            )
    return {name: _merge_tensor(name, [sd[name] for sd in state_dicts], coefs) for name in names}


def _merge_tensor(name: str, tensors: list[torch.Tensor], coefs: list[float]) -> torch.Tensor:
    first = tensors[0]
    for k, t in enumerate(tensors[1:], start=1):
        if t.shape != first.shape:
            raise ValueError(
                f"{name}: state_dicts[{k}] has shape {tuple(t.shape)}, expected {tuple(first.shape)}"
            )
    if not first.is_floating_point():
        if any(not torch.equal(t, first) for t in tensors[1:]):
            raise ValueError(f"{name}: non-float tensors differ between state dicts; cannot merge them")
        return first.clone()
    acc_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    acc = torch.zeros(first.shape, dtype=acc_dtype, device=first.device)
    for c, t in zip(coefs, tensors, strict=True):
        acc.add_(t.to(acc_dtype), alpha=c)
    return acc.to(first.dtype)


def extrapolation_factor(alpha: float) -> float:
    """k = 1 / (1 - a), the paper's extrapolation factor for a in [0, 1) (it searches a in 0.1..0.5)."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    return 1.0 / (1.0 - alpha)


def bone_soup_merge(
    backbones: Sequence[Mapping[str, torch.Tensor]],
    preference: Sequence[float],
    *,
    beta: float,
    sft: Mapping[str, torch.Tensor] | None = None,
    alphas: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """The merged model for `preference`: lambda = B(n, beta)^-T mu, then sum_k lambda_k theta'_k with
    theta'_k = theta_0 + k_k (theta_k - theta_0), k_k = 1 / (1 - alphas[k]) when `sft` (theta_0) is given.
    Since sum lambda = 1 this is theta_0 + sum_k lambda_k k_k (theta_k - theta_0)."""
    lam = merge_coefficients(backbone_matrix(len(backbones), beta), preference)
    if sft is None:
        if alphas is not None:
            raise ValueError("alphas needs sft: extrapolation is away from the SFT model")
        return merge_state_dicts(backbones, lam)
    alphas = [0.0] * len(backbones) if alphas is None else list(alphas)
    if len(alphas) != len(backbones):
        raise ValueError(f"alphas has {len(alphas)} entries for {len(backbones)} backbones")
    factors = [extrapolation_factor(a) for a in alphas]
    # theta_0 * (1 - sum_k lambda_k k_k) + sum_k lambda_k k_k theta_k, one fp32 pass
    coefs = [float(lam[k]) * factors[k] for k in range(len(backbones))]
    return merge_state_dicts([sft, *backbones], [1.0 - sum(coefs), *coefs])
