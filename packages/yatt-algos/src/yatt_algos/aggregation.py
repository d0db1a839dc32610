"""Loss aggregation: per-token values [B, T] and a mask to one scalar, in the five modes of verl.

Each mode divides by a normalizer that can be given globally (`num_tokens`, `num_seqs` over all micro-batches
and data-parallel ranks), which makes the aggregate additive: the sum over micro-batches (and ranks, after the
gradient all-reduce sums them) equals the aggregate of the whole batch, so gradient accumulation and data
parallelism give exactly the single-batch gradient. Without them the call's own counts are used.

- token-mean: sum_{i,t} v / num_tokens (DAPO's token-level loss, arXiv 2503.14476).
- seq-mean-token-sum: sum_i (sum_t v) / num_seqs.
- seq-mean-token-mean: sum_i (mean_t v) / num_seqs (the original GRPO, arXiv 2402.03300).
- seq-mean-token-sum-norm: sum_{i,t} v / (num_seqs * max_len) (Dr.GRPO's constant normalizer,
  arXiv 2503.20783; it uses the generation budget, here `max_len`, default T).
- token-sum: sum_{i,t} v, no normalizer (verl's "token-sum"; the loss scales with the batch's token count, so
  the learning rate must be tuned to the batch size). Additive without any global count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_algos.checks import as_bool_mask, check_same_shape


def _token_mean(values, mask, num_tokens, num_seqs, max_len):
    return values.sum() / num_tokens


def _seq_mean_token_sum(values, mask, num_tokens, num_seqs, max_len):
    return values.sum() / num_seqs


def _seq_mean_token_mean(values, mask, num_tokens, num_seqs, max_len):
    per_seq = values.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # [B]; empty rows give 0
    return per_seq.sum() / num_seqs


def _seq_mean_token_sum_norm(values, mask, num_tokens, num_seqs, max_len):
    return values.sum() / (num_seqs * max_len)


def _token_sum(values, mask, num_tokens, num_seqs, max_len):
    return values.sum()


# Each: (values zeroed where masked [B, T], float mask [B, T], num_tokens, num_seqs, max_len) -> scalar
AGG_MODES: dict[str, Callable] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    "token-sum": _token_sum,
}


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregate per-token `values` [B, T] under `mask` [B, T] to a scalar by `mode` (see the module doc).

    num_tokens: unmasked tokens of the whole batch (default: this mask's). num_seqs: sequences with at least
    one unmasked token in the whole batch (default: this mask's). max_len: Dr.GRPO's constant (default T).
    A call whose own mask is empty returns 0 (still attached to the graph) when the global counts are given,
    as a padding micro-batch must; without them it is an error.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode {mode!r} is not one of {sorted(AGG_MODES)}")
    check_same_shape("values", {"values": values, "mask": mask})
    bmask = as_bool_mask("mask", mask)
    fmask = bmask.to(values.dtype)
    masked = torch.where(
        bmask, values, torch.zeros((), dtype=values.dtype, device=values.device)
    )  # NaN/inf in padding never leak
    if num_tokens is None:
        num_tokens = float(fmask.sum())
    if num_seqs is None:
        num_seqs = float((fmask.sum(dim=-1) > 0).sum())
    if max_len is None:
        max_len = values.shape[-1]
    for name, count in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("max_len", max_len)):
        if count <= 0:
            raise ValueError(f"{name} must be > 0, got {count} (is the mask all zeros?)")
    return AGG_MODES[mode](masked, fmask, num_tokens, num_seqs, max_len)
