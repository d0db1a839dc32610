"""The critic's clipped value loss, and per-token logprobs and entropy from logits.

`logprobs_from_logits` and `entropy_from_logits` work in row chunks: each chunk is upcast to fp32 alone, so a
large vocabulary never materializes a full fp32 copy of [B, T, V]. Under autograd each chunk is recomputed in
the backward pass (activation checkpointing), so the saved state is the logits themselves, not a softmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from yatt_algos.checks import as_bool_mask, check_same_shape


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (arXiv 1707.06347 as implemented in OpenAI baselines), per token [B, T].

    v_clip = old + clamp(v - old, -clip_range, clip_range); loss = 0.5 * max((v - R)^2, (v_clip - R)^2),
    zero where masked (aggregate it with `aggregation.aggregate`). Metrics: vf_clip_frac (share of tokens
    where the clipped term is the larger), value_mean, return_mean, vf_explained_var.
    """
    check_same_shape("values", {"values": values, "old_values": old_values, "returns": returns, "mask": mask})
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    bmask = as_bool_mask("mask", mask)
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_plain = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    loss = torch.where(bmask, 0.5 * torch.maximum(loss_plain, loss_clipped), 0.0)
    with torch.no_grad():
        n = bmask.sum().clamp(min=1)
        v, r = values.detach(), returns.detach()
        residual_var = _masked_var(r - v, bmask)
        metrics = {
            "vf_clip_frac": ((loss_clipped > loss_plain) & bmask).sum() / n,
            "value_mean": torch.where(bmask, v, 0.0).sum() / n,
            "return_mean": torch.where(bmask, r, 0.0).sum() / n,
            "vf_explained_var": 1.0 - residual_var / _masked_var(r, bmask).clamp(min=1e-8),
        }
    return loss, metrics


def _masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum().clamp(min=1)
    mean = torch.where(mask, x, 0.0).sum() / n
    return torch.where(mask, (x - mean).square(), 0.0).sum() / n


def _fp32_finite(logits: torch.Tensor) -> torch.Tensor:
    """The chunk in fp32; -inf logits (masked vocabulary) become the lowest finite float, so p * log p is
    0, not NaN. The check is one reduction; the rewrite happens only when a -inf is present."""
    x = logits.float()
    if bool(x.amin() == -torch.inf):
        x = x.masked_fill(torch.isneginf(x), torch.finfo(torch.float32).min)
    return x


def _entropy_of(log_p: torch.Tensor) -> torch.Tensor:
    """H = -sum p log p for fp32 log-probabilities [N, V]: the sum is a batched dot product, so p * log p is
    never materialized (one extra [N, V] buffer: p)."""
    return -torch.bmm(log_p.exp().unsqueeze(1), log_p.unsqueeze(-1)).view(-1)


def _logprobs_chunk(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(logits.float(), dim=-1)  # [N, V], only this chunk in fp32
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _entropy_chunk(logits: torch.Tensor) -> torch.Tensor:
    return _entropy_of(torch.log_softmax(_fp32_finite(logits), dim=-1))


def _both_chunk(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(_fp32_finite(logits), dim=-1)  # [N, V], one softmax for both figures
    return torch.stack([log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), _entropy_of(log_p)], dim=-1)


def _chunked(fn: Callable, chunk_size: int, *flat: torch.Tensor) -> torch.Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    grad = torch.is_grad_enabled() and flat[0].requires_grad
    outs = []
    for start in range(0, flat[0].shape[0], chunk_size):
        parts = [t[start : start + chunk_size] for t in flat]
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if grad else fn(*parts))
    if not outs:
        return torch.zeros(0, dtype=torch.float32, device=flat[0].device)
    return torch.cat(outs)


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {tuple(logits.shape[:2])}")
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024
) -> torch.Tensor:
    """log softmax(logits)[label] per position, in fp32. logits [B, T, V], labels [B, T] int -> [B, T].

    Rows of `chunk_size` positions are processed at a time. The caller aligns labels to logits (for a causal
    LM, logits[:, :-1] predict input_ids[:, 1:]).
    """
    _check_logits_labels(logits, labels)
    b, t, v = logits.shape
    flat = _chunked(_logprobs_chunk, chunk_size, logits.reshape(b * t, v), labels.reshape(b * t).long())
    return flat.view(b, t)


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) per position, in fp32, numerically stable. [B, T, V] -> [B, T]."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    b, t, v = logits.shape
    return _chunked(_entropy_chunk, chunk_size, logits.reshape(b * t, v)).view(b, t)


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of the above in one pass over the logits (each chunk upcast once). [B, T, V], [B, T] -> two [B, T]."""
    _check_logits_labels(logits, labels)
    b, t, v = logits.shape
    flat = _chunked(_both_chunk, chunk_size, logits.reshape(b * t, v), labels.reshape(b * t).long())
    flat = flat.view(b, t, 2) if flat.numel() else flat.new_zeros(b, t, 2)
    return flat[..., 0], flat[..., 1]
