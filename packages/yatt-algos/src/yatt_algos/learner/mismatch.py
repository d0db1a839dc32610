"""The rollout/train mismatch metric: how far the trainer's logprobs of the sampled tokens are from the
rollout engine's (bf16 kernels, other attention code), on the same weights.

Compare `compute_logprobs(batch)` with the engine's logprobs before training on a batch; a large mismatch is
the reason to turn on the truncated importance sampling of `rollout_correction` (AlgoConfig.rollout_is_level).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def mismatch_metrics(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Token means over `mask` [B, T] (and over the ranks of `group`) of |train - rollout| and of the k3
    estimate of KL(rollout || train) on the rollout's samples, plus the max |train - rollout|.
    train_logprobs, rollout_logprobs [B, T]."""
    for name, t in (("train_logprobs", train_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, mask has {tuple(mask.shape)}")
    mask = mask.bool()
    x = torch.where(mask, train_logprobs.double() - rollout_logprobs.double(), 0.0)  # log(train / rollout)
    k3 = torch.expm1(x.clamp(-20, 20)) - x.clamp(-20, 20)
    sums = torch.stack([mask.sum().double(), x.abs().sum(), k3.sum()])
    top = x.abs().max() if mask.any() else x.new_zeros(())
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    n = max(float(sums[0]), 1.0)
    return {
        "mismatch_abs_mean": float(sums[1]) / n,
        "mismatch_abs_max": float(top),
        "mismatch_k3": float(sums[2]) / n,
    }
