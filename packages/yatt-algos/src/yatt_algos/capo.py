"""CAPO: credit assignment from LLM critiques (arXiv 2508.02298).

A rule verifier gives r_v in {0, 1} per response; K critiques each list the response's wrong steps. The wrong
steps are voted (`vote_wrong_steps`), steps are mapped to token positions (`split_steps`,
`char_spans_to_token_spans`), each token gets R_t = r_v * W_whole - 1[t in a wrong step] * W_process
(`capo_token_rewards`, W_whole = 2, W_process = 1: every token of a correct answer outranks every token of a
wrong one), and R is normalized over all tokens of all responses to the same prompt (`capo_advantages`)
before a PPO-clip update.

Departure: in "average" mode the paper scales the penalty by the fraction of critiques flagging the step;
the weight here is exactly that fraction, so "average" with K = 1 equals "union".
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

import torch

from yatt_algos.checks import as_bool_mask, check_2d, check_no_empty_rows
from yatt_algos.groups import group_token_mean_std

VOTING_MODES = ("intersection", "majority", "union", "average")
# A step starts after a blank line, or at an explicit marker such as "Step 3:" / "Step 3." at a line start.
_STEP_BREAK = re.compile(r"\n[ \t]*\n\s*|\n(?=[ \t]*Step\s+\d+\s*[:.])", re.IGNORECASE)


def vote_wrong_steps(
    critiques: Sequence[Collection[int]], mode: str, *, num_steps: int | None = None
) -> dict[int, float]:
    """Combine K critiques' wrong-step sets into {step: penalty weight}.

    intersection: flagged by all K; majority: flagged by strictly more than K / 2; union: by any; these give
    weight 1. average: weight = (number of critiques flagging the step) / K. Steps are 0-based indices.
    """
    if mode not in VOTING_MODES:
        raise ValueError(f"mode {mode!r} is not one of {list(VOTING_MODES)}")
    if len(critiques) == 0:
        raise ValueError("critiques is empty (K=0): at least one critique is needed to vote")
    counts: dict[int, int] = {}
    for k, steps in enumerate(critiques):
        for step in set(steps):
            if not isinstance(step, int) or step < 0 or (num_steps is not None and step >= num_steps):
                raise ValueError(f"critiques[{k}] flags step {step!r}, outside 0..{(num_steps or 0) - 1}")
            counts[step] = counts.get(step, 0) + 1
    num = len(critiques)
    if mode == "average":
        return {s: c / num for s, c in sorted(counts.items())}
    need = {"intersection": num, "majority": num // 2 + 1, "union": 1}[mode]
    return {s: 1.0 for s, c in sorted(counts.items()) if c >= need}


def split_steps(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the steps of a response: split on blank lines or on explicit step
    markers ("Step N:" at a line start). Separators belong to no step; empty steps are dropped."""
    spans, start = [], 0
    for match in _STEP_BREAK.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    spans.append((start, len(text)))
    return [(s, e) for s, e in spans if text[s:e].strip()]


def char_spans_to_token_spans(
    char_spans: Sequence[tuple[int, int]], token_offsets: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Map step character spans to token spans [first, last + 1) of the response's tokens.

    token_offsets[i] is token i's character span (a fast tokenizer's offset mapping). A token belongs to
    the first step it overlaps; a step no token overlaps gets the empty span (s, s).
    """
    owner = [-1] * len(token_offsets)
    for i, (ts, te) in enumerate(token_offsets):
        for k, (cs, ce) in enumerate(char_spans):
            if ts < ce and cs < max(te, ts + 1):  # zero-width tokens count at their position
                owner[i] = k
                break
    out = []
    for k in range(len(char_spans)):
        tokens = [i for i, o in enumerate(owner) if o == k]
        out.append((tokens[0], tokens[-1] + 1) if tokens else (0, 0))
    return out


def capo_token_rewards(
    verifier_rewards: torch.Tensor,
    step_spans: Sequence[Sequence[tuple[int, int]]],
    wrong_steps: Sequence[dict[int, float]],
    response_mask: torch.Tensor,
    *,
    w_whole: float = 2.0,
    w_process: float = 1.0,
) -> torch.Tensor:
    """R_t = r_v * w_whole - penalty(t) * w_process on response tokens, 0 elsewhere. [B, T].

    verifier_rewards [B] (r_v); step_spans[b] the token spans [start, end) of row b's steps as column
    indices into the [B, T] tensors (offset by the prompt length where the row starts with the prompt);
    wrong_steps[b] row b's vote ({step: weight}); penalty(t) is the weight of the wrong step covering t.
    """
    check_2d("response_mask", response_mask)
    num_rows, num_cols = response_mask.shape
    if verifier_rewards.shape != (num_rows,):
        raise ValueError(
            f"verifier_rewards must have shape ({num_rows},), got {tuple(verifier_rewards.shape)}"
        )
    if len(step_spans) != num_rows or len(wrong_steps) != num_rows:
        raise ValueError(
            f"step_spans and wrong_steps need {num_rows} rows, got {len(step_spans)}, {len(wrong_steps)}"
        )
    mask = as_bool_mask("response_mask", response_mask)
    penalty = torch.zeros(num_rows, num_cols, dtype=torch.float32)  # built on CPU: per-span writes
    for b, (spans, wrong) in enumerate(zip(step_spans, wrong_steps, strict=True)):
        for step, weight in wrong.items():
            if not 0 <= step < len(spans):
                raise ValueError(f"wrong_steps[{b}] names step {step}, but row {b} has {len(spans)} steps")
            start, end = spans[step]
            if not 0 <= start <= end <= num_cols:
                raise ValueError(f"step_spans[{b}][{step}] = {(start, end)} is outside 0..{num_cols}")
            penalty[b, start:end] = penalty[b, start:end].clamp(min=weight)
    rewards = verifier_rewards.float().unsqueeze(-1) * w_whole - penalty.to(mask.device) * w_process
    return torch.where(mask, rewards, 0.0)


def capo_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """(R_t - mean) / (std + eps), mean and unbiased std over all tokens of all responses of the row's
    prompt group. token_rewards, response_mask [B, T]; group_ids [B] -> [B, T], zero where masked."""
    check_2d("token_rewards", token_rewards)
    if tuple(response_mask.shape) != tuple(token_rewards.shape):
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)}, expected {tuple(token_rewards.shape)}"
        )
    mask = as_bool_mask("response_mask", response_mask)
    check_no_empty_rows("response_mask", mask)
    mean, std, _ = group_token_mean_std(token_rewards, mask, group_ids)
    adv = (token_rewards - mean.unsqueeze(-1)) / (std.unsqueeze(-1) + eps)
    return torch.where(mask, adv, 0.0)
