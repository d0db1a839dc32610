"""Continuous batching for `HFEngine`: rows queued while a batch decodes join it between two decode steps.

Admission prefills only the new rows and merges their KV cache into the running batch's (way (a) of issue
31): the running rows keep their cache, so joining costs one forward over the new prompts, the same forward
they would get in a batch of their own. Re-prefilling the running rows with the new ones (as a partial weight
update must, since the weights changed) would cost a forward over every running row's whole context at each
admission, which on the agentic workload (episodes' next turns arriving one by one) is tens of decode steps
each time.

The two caches are left-padded to one length along the sequence axis (the padding is masked out, exactly like
a short prompt's in a fresh batch), then concatenated along the batch axis: the running rows first, the new
ones after. Positions follow the attention mask, so a padded row's positions are what they were alone.

What is not admitted (those rows wait for the next batch, as before): constrained rows (`choices`,
`allowed_token_ids`: their transition states are per batch), image prompts, any row of a VLM engine (its
M-RoPE deltas and vision inputs are per batch), any row of an engine that records MoE routing (its route
buffer is laid out per batch), and caches that are not plain `DynamicLayer`s (sliding windows, quantized or
offloaded caches).
"""

from __future__ import annotations

from typing import Any

import torch

from yatt_rollout.live_rows import LiveRows
from yatt_rollout.types import FinishReason


def mergeable(cache: Any) -> bool:
    """Whether `cache` is a plain dynamic cache whose layers' key/value tensors can be padded and joined."""
    from transformers.cache_utils import DynamicLayer

    layers: list[Any] = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def admissible(request: Any) -> bool:
    """Whether a queued row of this `BatchRequest` may join a running batch (unconstrained, text only)."""
    return request.constraint is None and not request.vision


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def merge(cache: Any, mask: torch.Tensor, new_cache: Any, new_mask: torch.Tensor) -> torch.Tensor:
    """Join `new_cache` (rows [N], attention mask `new_mask` [N, T2]) into `cache` (rows [L], `mask` [L, T1])
    in place: keys and values [B, H, T, D] left-padded to max(T1, T2), the new rows after the running ones.
    Returns the joined attention mask [L + N, max(T1, T2)]."""
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, new in zip(cache.layers, new_cache.layers, strict=True):
        layer.keys = torch.cat([_pad_left(layer.keys, width, 2), _pad_left(new.keys, width, 2)])
        layer.values = torch.cat([_pad_left(layer.values, width, 2), _pad_left(new.values, width, 2)])
    return torch.cat([_pad_left(mask, width, 1), _pad_left(new_mask, width, 1)])


def ended(
    rows: LiveRows, before: torch.Tensor, keep: torch.Tensor
) -> list[tuple[int, tuple[list[int], list[float], FinishReason]]]:
    """(batch index, (tokens, logprobs, finish reason)) of each row that ended at this step, answered at once
    (`before`: the live rows before the step; `keep`: the positions in it that go on): one transfer of
    their tokens, logprobs, lengths and stop flags."""
    gone = torch.ones(len(before), dtype=torch.bool, device=before.device)
    gone[keep] = False
    done = before[gone]
    tokens, logprobs = rows.tokens[done].tolist(), rows.logprobs[done].tolist()
    ends, stopped = rows.ends[done].tolist(), rows.stopped[done].tolist()
    return [
        (i, (t[:e], lp[:e], "stop" if s else "length"))
        for i, t, lp, e, s in zip(done.tolist(), tokens, logprobs, ends, stopped, strict=True)
    ]


def carry(seg: list[Any], rows: LiveRows, step: int) -> list[Any]:
    """The rows still running at a join, in their cache order, each with its `step` tokens of the ending
    segment appended to its `tokens` / `logprobs` (the next segment's context and results start there)."""
    live = rows.live
    tokens, logprobs = rows.tokens[live, :step].tolist(), rows.logprobs[live, :step].tolist()
    running = [seg[i] for i in live.tolist()]
    for row, t, lp in zip(running, tokens, logprobs, strict=True):
        row.tokens, row.logprobs = row.tokens + t, row.logprobs + lp
    return running


def join(
    engine: Any,
    seg: list[Any],
    rows: LiveRows,
    step: int,
    new: list[Any],
    state: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[list[Any], LiveRows, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Start a new segment of `engine`'s running batch with the `new` rows joined, before the sampling of the
    segment's step `step`. `state`: the running rows' KV cache, attention mask, positions and next-token
    logits. The running rows keep their tokens so far (`carry`), their KV cache and their seeded draws;
    the new rows are prefilled alone and their cache merged after the running rows' (`merge`). Returns the
    segment's rows, LiveRows, prompt ids and mask (the contexts a partial update re-prefills), attention
    mask, positions and next-token logits."""
    cache, mask, pos, logits = state
    running = carry(seg, rows, step)
    new_ids, new_mask, _ = engine._left_pad(new)
    out, new_cache, new_mask, new_pos, _ = engine._prefill(new, new_ids, new_mask)
    mask = merge(cache, mask, new_cache, new_mask)
    seg = running + new
    prompt_ids, prompt_mask, budget = engine._left_pad(seg)
    carried = rows.unused_draws(step)  # the running rows' seeded streams go on where they were
    rows = LiveRows.build(seg, budget, engine.eos_ids, engine.vocab_size, engine.device, carried)
    engine.stats["admissions"] += 1
    engine.stats["admitted_rows"] += len(new)
    engine.stats["rows"] += len(new)
    pos = torch.cat([pos, new_pos])
    return seg, rows, prompt_ids, prompt_mask, mask, pos, torch.cat([logits, out.logits[:, -1]])
