"""Group statistics by group id: the samples of one prompt share an id, in any order (groups need not be
contiguous, and ids need not be 0..G-1). Everything is vectorized with `index_add_`, no Python loop."""

from __future__ import annotations

import torch

from yatt_algos.checks import check_rows


def group_index(group_ids: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, int]:
    """Dense group index [B] in 0..G-1 and G, from arbitrary integer ids [B]."""
    check_rows("group_ids", group_ids, num_rows)
    if num_rows == 0:
        raise ValueError("group_ids is empty: there are no groups")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1


def group_sums(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of values [B] per group -> [G] (float64 for an exact-enough mean of large groups)."""
    out = torch.zeros(num_groups, dtype=torch.float64, device=values.device)
    return out.index_add_(0, index, values.double())


def group_mean_std(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row mean, unbiased std and size of its group: values [B] -> three [B] tensors.

    A group of size 1 has std 0, never NaN; computed in float64, returned in values' dtype.
    """
    mask = torch.ones(values.shape[0], 1, dtype=torch.bool, device=values.device)
    return group_token_mean_std(values.unsqueeze(-1), mask, group_ids)


def group_token_mean_std(
    values: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, unbiased std and token count over all unmasked tokens of each row's group.

    values [B, T], bool mask [B, T], group_ids [B] -> three [B] tensors (each row gets its group's figures).
    Two passes (mean, then squared deviations) in float64, so large groups stay exact. A group with at most
    one token has std 0.
    """
    index, num_groups = group_index(group_ids, values.shape[0])
    v = torch.where(mask, values.double(), 0.0)
    count = group_sums(mask.sum(dim=-1), index, num_groups)  # [G]
    mean = group_sums(v.sum(dim=-1), index, num_groups) / count.clamp(min=1)
    dev2 = torch.where(mask, (values.double() - mean[index].unsqueeze(-1)).square(), 0.0)
    var = group_sums(dev2.sum(dim=-1), index, num_groups) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), 0.0)
    dtype = values.dtype
    return mean[index].to(dtype), std[index].to(dtype), count[index].to(dtype)
