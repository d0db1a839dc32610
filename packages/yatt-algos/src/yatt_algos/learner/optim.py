"""AdamW with linear warmup and cosine decay, and the guarded optimizer step.

The guard: gradients are clipped to `clip_grad_norm` and, when their total norm is not finite, the step is
skipped: no optimizer or scheduler step, so parameters, Adam moments and the step count stay bit-identical,
and the gradients are dropped. Under data parallelism the norm is computed from all-reduced (DDP) or sharded
(FSDP2, Megatron) gradients, so every rank takes the same decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from yatt_algos.types import OptimConfig


def lr_ratio(step: int, *, num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based).

    Warmup: (step + 1) / num_warmup_steps, so the first step already moves. Then cosine from 1 down to
    `min_lr_ratio` at `num_training_steps`, held there afterwards.
    """
    if step < num_warmup_steps:
        return (step + 1) / num_warmup_steps
    progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_ratio`; sets the lr of step 0 right away."""

    def ratio(step: int) -> float:
        return lr_ratio(
            step,
            num_warmup_steps=cfg.num_warmup_steps,
            num_training_steps=cfg.num_training_steps,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, ratio)


def average_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter's gradient over the data-parallel `group` (all-reduce, then / world size);
    a no-op for one rank. For learners that hold a plain module per rank (no DDP wrapper)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)


def guarded_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    max_norm: float,
    clip_fn: Callable[[list[torch.nn.Parameter], float], float] | None = None,
) -> tuple[float, bool]:
    """Clip, then step unless the gradient norm is not finite. Returns (grad norm before clipping, applied).

    `clip_fn(params, max_norm) -> norm` replaces torch's clip_grad_norm_ where parameters are sharded in ways
    it cannot see (Megatron's tensor parallel).
    """
    with_grad = [p for p in params if p.grad is not None]
    max_norm = max_norm if max_norm > 0 else float("inf")
    if clip_fn is not None:
        norm = float(clip_fn(with_grad, max_norm))
    else:
        total = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
        if hasattr(total, "full_tensor"):  # FSDP2: a DTensor
            total = total.full_tensor()
        norm = float(total)
    applied = math.isfinite(norm)
    if applied:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, applied
