"""Sample filters and reward shaping from DAPO (Yu et al., arXiv 2503.14476).

- Dynamic sampling: drop prompt groups whose rewards are all equal (zero variance gives zero GRPO advantage,
  so the group only dilutes the batch); report how many groups were kept and dropped. The refill loop
  (generate more prompts until the batch is full) belongs to the controller; this is its filter step.
- Overlong reward shaping: a soft length penalty over a buffer before the maximum response length.
- Overlong filtering: truncated responses (no end of sequence) are masked out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yatt_algos.checks import as_bool_mask, check_2d, check_rows
from yatt_algos.groups import group_index


@dataclass(frozen=True)
class GroupFilter:
    """What `dynamic_sampling_filter` decided. keep [B] bool (rows of kept groups); the group ids kept and
    dropped, each in ascending order; their counts."""

    keep: torch.Tensor
    kept_groups: list[int]
    dropped_groups: list[int]

    @property
    def num_kept(self) -> int:
        return len(self.kept_groups)

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_groups)


def dynamic_sampling_filter(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, atol: float = 0.0
) -> GroupFilter:
    """Keep the groups whose rewards are not all equal (max - min > atol). rewards [B], group_ids [B].

    A group of one sample has nothing to compare and is dropped, as DAPO's "0 < #correct < G" implies.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    index, num_groups = group_index(group_ids, rewards.shape[0])
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    r = rewards.double()
    high = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, index, r, "amax"
    )
    low = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, index, r, "amin"
    )
    varied = (high - low) > atol  # [G]
    ids = torch.unique(group_ids)  # sorted; position g holds the id of dense group g
    return GroupFilter(
        keep=varied[index],
        kept_groups=ids[varied].tolist(),
        dropped_groups=ids[~varied].tolist(),
    )


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, to add to each response's reward. response_lengths [B] -> [B].

    With L = max_len - buffer_len: 0 for length <= L; (L - length) / buffer_len * penalty_factor inside the
    buffer; -penalty_factor at or beyond max_len. buffer_len = 0 disables it (all zeros).
    """
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be [B], got shape {tuple(response_lengths.shape)}")
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(f"buffer_len must be in [0, max_len={max_len}], got {buffer_len}")
    if buffer_len == 0:
        return torch.zeros(response_lengths.shape, dtype=torch.float32, device=response_lengths.device)
    expected = max_len - buffer_len
    over = (response_lengths.float() - expected).clamp(min=0.0, max=float(buffer_len))
    return -over / buffer_len * penalty_factor


def mask_truncated(response_mask: torch.Tensor, truncated: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DAPO's overlong filtering: zero the loss mask of truncated responses. response_mask [B, T],
    truncated [B] bool (finish reason "length") -> (mask [B, T] of response_mask's dtype, rows masked)."""
    check_2d("response_mask", response_mask)
    check_rows("truncated", truncated, response_mask.shape[0])
    keep = ~as_bool_mask("truncated", truncated)
    mask = as_bool_mask("response_mask", response_mask) & keep.unsqueeze(-1)
    return mask.to(response_mask.dtype), int((~keep).sum())
