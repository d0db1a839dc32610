"""From an `Experience` to mini-batches and micro-batches.

A batch is a dict of tensors, every one [B, T] (right padded) except the per-row fields (`ROW_FIELDS`):
`group_ids` [B], and for vision-language policies `pixel_values` [B, P, D] (row b's image patches, zero padded
to P) and `image_grid_thw` [B, N, 3] (row b's images, all-zero rows as padding). Mini-batches are
contiguous slices of B (one optimizer step each); micro-batches split a mini-batch for gradient accumulation,
either `micro_batch_size` sequences at a time or packed by a token budget: sequences sorted by length and
grouped so that each micro-batch's padded size (count x longest) stays within the budget, which puts long
sequences together in small micro-batches and short ones together in large ones. Each micro-batch is trimmed
to its own longest sequence; with right padding and causal attention that changes no real token's output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from yatt_algos import tensor_codec
from yatt_algos.types import Experience

Batch = dict[str, torch.Tensor]

_FLOAT_FIELDS = ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs", "returns", "old_values")
_MASK_FIELDS = ("attention_mask", "response_mask")
# leading dim B, not cut to a micro-batch's T; `row_index` [B] is each row's position in the whole batch (set by
# a learner that scatters per-micro-batch outputs back into [B, T])
ROW_FIELDS = ("group_ids", "pixel_values", "image_grid_thw", "row_index")


def experience_to_batch(exp: Experience) -> Batch:
    """Decode an `Experience` (zero-copy views where the dtype already fits) into a checked `Batch`."""
    fields = {}
    for name in ("input_ids", *_MASK_FIELDS, *_FLOAT_FIELDS, "group_ids"):
        enc = getattr(exp, name)
        if enc is not None:
            fields[name] = tensor_codec.decode_torch(enc)
    return as_batch(fields)


def as_batch(batch: Experience | Mapping[str, Any]) -> Batch:
    """Check shapes and dtypes: ints for ids, bool masks, float32 values. Raises ValueError naming the field."""
    if isinstance(batch, Experience):
        return experience_to_batch(batch)
    for name in ("input_ids", "attention_mask"):
        if name not in batch:
            raise ValueError(f"batch has no {name!r} (fields: {sorted(batch)})")
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer [B, T] tensor, got {ids.dtype} {tuple(ids.shape)}")
    out: Batch = {"input_ids": ids.long()}
    for name, value in batch.items():
        if name == "input_ids" or value is None:
            continue
        if name == "group_ids":
            if tuple(value.shape) != tuple(ids.shape[:1]):
                raise ValueError(f"group_ids has shape {tuple(value.shape)}, expected ({ids.shape[0]},)")
        elif name in ROW_FIELDS:
            if value.dim() < 1 or value.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, expected ({ids.shape[0]}, ...) rows"
                )
        elif tuple(value.shape) != tuple(ids.shape):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}, expected {tuple(ids.shape)} like input_ids"
            )
        if name in _MASK_FIELDS:
            out[name] = value.bool()
        elif name in _FLOAT_FIELDS:
            out[name] = value.float()
        else:
            out[name] = value
    return out


def seq_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last attended token + 1 per row (0 for an empty row). [B, T] -> [B] int64."""
    t = attention_mask.shape[1]
    pos = torch.arange(1, t + 1, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), pos, 0).amax(dim=1)


def split_mini_batches(num_seqs: int, mini_batch_size: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch: contiguous slices of `mini_batch_size` (0: one mini-batch)."""
    if num_seqs < 1:
        raise ValueError("the batch is empty (B = 0)")
    size = mini_batch_size or num_seqs
    if num_seqs % size:
        raise ValueError(f"batch size {num_seqs} is not a multiple of OptimConfig.mini_batch_size {size}")
    return [torch.arange(start, start + size) for start in range(0, num_seqs, size)]


def pack_micro_batches(lengths: list[int], *, micro_batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Positions (into `lengths`) of each micro-batch.

    max_tokens == 0: consecutive groups of `micro_batch_size`. max_tokens > 0: positions sorted by length
    (longest first, ties in order), cut whenever one more sequence would make count x longest exceed the budget.
    """
    if max_tokens == 0:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths))))
            for i in range(0, len(lengths), micro_batch_size)
        ]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(
                f"a sequence of {lengths[i]} tokens exceeds LearnerConfig.max_tokens_per_micro_batch={max_tokens}"
            )
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def select(batch: Batch, rows: torch.Tensor | list[int], max_len: int | None = None) -> Batch:
    """Rows `rows` of every field, [B, T] fields cut to the first `max_len` columns."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    out = {}
    for name, value in batch.items():
        picked = value[rows]
        out[name] = picked if max_len is None or name in ROW_FIELDS else picked[:, :max_len]
    return out


def micro_batches(
    batch: Batch, rows: torch.Tensor, *, micro_batch_size: int, max_tokens: int
) -> list[tuple[torch.Tensor, Batch]]:
    """(rows of `batch`, micro-batch) for each micro-batch of the mini-batch `rows`, each trimmed to its
    longest sequence."""
    lengths = seq_lengths(batch["attention_mask"][rows]).tolist()
    out = []
    for group in pack_micro_batches(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens):
        longest = max(max(lengths[i] for i in group), 1)
        out.append((rows[group], select(batch, rows[group], longest)))
    return out
