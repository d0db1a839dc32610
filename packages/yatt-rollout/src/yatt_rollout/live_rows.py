"""Per-row decoding state of an `HFEngine` batch, kept on the model's device.

`LiveRows` holds the rows still running (their batch indices), their sampling parameters, stop ids, budgets
and constraint states, and the [B, W] buffers their tokens and logprobs go into. Each step `record` writes
the step's tokens, checks stops and budgets on the device and reads back one flag (did any row end?); only
on steps where rows end does it read which, so the caller can narrow the model's batch and KV cache to the
rows that go on. `results` is the batch's one transfer of tokens and logprobs to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from yatt_rollout import sampling
from yatt_rollout.constraints import BatchConstraint
from yatt_rollout.types import FinishReason


@dataclass
class LiveRows:
    """Per-row decoding state of a batch, on the device: the rows still running (`live`, batch indices),
    their sampling parameters, stop ids and budgets, and the [B, W] token and logprob buffers they fill.
    `record` keeps everything aligned with the model's batch as rows leave it."""

    live: torch.Tensor  # [L] long: batch index of each running row
    params: dict[str, torch.Tensor]  # host tensors [L]: temperature, top_k, top_p
    seeded: list[bool]  # [L]: the row's request has a seed
    # [L, W] float64: each seeded row's uniforms, one per token it may sample (its own stream, drawn at once)
    draws: torch.Tensor | None
    stop_ids: torch.Tensor  # [L, S] long, padded with -1
    budget: torch.Tensor  # [L] long: the row's token budget
    tokens: torch.Tensor  # [B, W] long
    logprobs: torch.Tensor  # [B, W] float32
    ends: torch.Tensor  # [B] long: tokens each row produced (set when it ends)
    stopped: torch.Tensor  # [B] bool: ended on a stop token
    constraint: BatchConstraint | None  # None when no row is constrained

    @classmethod
    def build(
        cls,
        batch: list[Any],
        budget: list[int],
        eos_ids: list[int],
        vocab: int,
        device: torch.device,
        carried: torch.Tensor | None = None,
    ) -> LiveRows:
        """`carried`: the uniforms still unused of the first rows (running rows that go on, `unused_draws`):
        their streams go on where they were."""
        sp = [r.request.req.sampling for r in batch]
        stops = [sorted(set(eos_ids) | set(s.stop_token_ids)) for s in sp]
        width = max(map(len, stops), default=0) or 1
        stop_ids = torch.tensor([ids + [-1] * (width - len(ids)) for ids in stops], dtype=torch.long)
        n, w = len(batch), max(budget)
        seeded = [s.seed is not None for s in sp]
        draws = None
        if any(seeded):  # one draw per row for its whole budget, not one per row per step
            kept = 0 if carried is None else len(carried)  # their draws come from `carried`, not a generator
            fresh = [
                _row_generator(s.seed, r.index, device) for s, r in zip(sp[kept:], batch[kept:], strict=True)
            ]
            draws = sampling.uniform_draws([None] * kept + fresh, w)
            if carried is not None:
                width = min(w, carried.shape[1])
                draws[:kept, :width] = carried[:, :width]
        return cls(
            live=torch.arange(n, device=device),
            params=sampling.row_params(
                [s.temperature for s in sp], [s.top_k for s in sp], [s.top_p for s in sp]
            ),
            seeded=seeded,
            draws=draws,
            stop_ids=stop_ids.to(device),
            budget=torch.tensor(budget, device=device),
            tokens=torch.zeros((n, w), dtype=torch.long, device=device),
            logprobs=torch.zeros((n, w), dtype=torch.float32, device=device),
            ends=torch.zeros(n, dtype=torch.long, device=device),
            stopped=torch.zeros(n, dtype=torch.bool, device=device),
            constraint=BatchConstraint.build([r.request.constraint for r in batch], vocab, eos_ids, device),
        )

    def record(self, step: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor | None:
        """Store step `step`'s tokens [L] and logprobs [L]. None if every row goes on, else the positions
        (device tensor) of the rows that do, and the state is narrowed to them."""
        self.tokens[self.live, step] = tokens
        self.logprobs[self.live, step] = logprobs
        if self.constraint is not None:
            self.constraint.advance(tokens)
        hit = (tokens[:, None] == self.stop_ids).any(-1)
        ended = hit | (self.budget <= step + 1)
        if not bool(ended.any()):  # the one host read of a step
            return None
        done = self.live[ended]
        self.ends[done] = step + 1
        self.stopped[done] = hit[ended]
        keep = (~ended).nonzero()[:, 0]
        host_keep = keep.tolist()
        self.live, self.stop_ids, self.budget = self.live[keep], self.stop_ids[keep], self.budget[keep]
        self.params = {k: v[host_keep] for k, v in self.params.items()}
        self.seeded = [self.seeded[j] for j in host_keep]
        self.draws = None if self.draws is None else self.draws[keep]
        if self.constraint is not None:
            self.constraint.select(keep)
        return keep

    def uniforms(self, step: int) -> torch.Tensor | None:
        """The running rows' uniforms for step `step` ([L] float64), None when no row is seeded."""
        return None if self.draws is None else self.draws[:, step]

    def unused_draws(self, step: int) -> torch.Tensor | None:
        """The running rows' uniforms from step `step` on ([L, W - step]), for `build(carried=...)`."""
        return None if self.draws is None else self.draws[:, step:]

    def results(self) -> list[tuple[list[int], list[float], FinishReason]]:
        """(tokens, logprobs, finish reason) per batch row: the batch's one transfer to the host."""
        ends, stopped = self.ends.tolist(), self.stopped.tolist()
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        return [
            (t[:e], lp[:e], "stop" if s else "length")
            for t, lp, e, s in zip(tokens, logprobs, ends, stopped, strict=True)
        ]


def _row_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    # sample i of a seeded request draws from its own stream: same (seed, i), same tokens, in any batch
    return None if seed is None else torch.Generator(device).manual_seed(seed * 1_000_003 + index)
