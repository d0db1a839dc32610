"""Constrained decoding for `HFEngine`: choice lists and allowed token ids, run on the device as one table.

A request with `sampling.choices` must complete to exactly one of those strings: each choice is tokenized
by the engine's tokenizer (no special tokens; the tokenizer's own encoding of the string, not every token
sequence that would decode to it) and the choices' token ids form a trie. At each position only the tokens
that continue some choice are allowed; where a choice is complete, eos is allowed too (and is the only
token if no longer choice continues there). `sampling.allowed_token_ids` is the one-state case: those ids
at every position.

A batch compiles its rows' constraints into one transition table `next_state [S, V]` (long, on the device):
state 0 is free (every token allowed, stays 0) for unconstrained rows, each distinct constraint appends its
states, and `next_state[s, t] = -1` marks token t as not allowed in state s. Each step masks the logits with
the rows' table rows and moves every row to `next_state[state, token]`: no host round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# what a request asks for: ("choices", token ids of each choice) or ("allowed", the allowed ids)
Spec = tuple[str, tuple[tuple[int, ...], ...]]


def choice_token_ids(tokenizer: Any, choices: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token ids of each choice under `tokenizer` (no special tokens added)."""
    return tuple(tuple(tokenizer.encode(c, add_special_tokens=False)) for c in choices)


def _trie_rows(seqs: tuple[tuple[int, ...], ...], first: int, vocab: int, eos_ids: list[int]) -> torch.Tensor:
    """Transition rows [n, V] of the trie of `seqs`, its states numbered from `first` (its root)."""
    children: list[dict[int, int]] = [{}]
    complete = [False]
    for seq in seqs:
        node = 0
        for token in seq:
            if token not in children[node]:
                children[node][token] = len(children)
                children.append({})
                complete.append(False)
            node = children[node][token]
        complete[node] = True
    rows = torch.full((len(children), vocab), -1, dtype=torch.long)
    for node, kids in enumerate(children):
        for token, child in kids.items():
            rows[node, token] = first + child
        if complete[node]:
            rows[node, eos_ids] = 0  # eos ends the row; the state after it is never read
    return rows


def _spec_rows(spec: Spec, first: int, vocab: int, eos_ids: list[int]) -> torch.Tensor:
    kind, payload = spec
    if kind == "choices":
        return _trie_rows(payload, first, vocab, eos_ids)
    row = torch.full((1, vocab), -1, dtype=torch.long)
    row[0, list(payload[0])] = first  # allowed ids: one state that loops on itself
    return row


@dataclass
class BatchConstraint:
    """The constrained decoding state of a batch: the table and each running row's state [L]."""

    next_state: torch.Tensor  # [S, V] long
    state: torch.Tensor  # [L] long

    @classmethod
    def build(
        cls, specs: Sequence[Spec | None], vocab: int, eos_ids: list[int], device: torch.device
    ) -> BatchConstraint | None:
        """None when no row is constrained; rows with spec None run free (state 0)."""
        if all(spec is None for spec in specs):
            return None
        blocks, roots = [torch.zeros((1, vocab), dtype=torch.long)], {}
        size = 1
        for spec in specs:
            if spec is not None and spec not in roots:
                roots[spec] = size
                blocks.append(_spec_rows(spec, size, vocab, eos_ids))
                size += len(blocks[-1])
        state = [0 if spec is None else roots[spec] for spec in specs]
        return cls(torch.cat(blocks).to(device), torch.tensor(state, dtype=torch.long, device=device))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [L, V] with the tokens each row's state does not allow set to -inf."""
        return logits.masked_fill(self.next_state[self.state] < 0, float("-inf"))

    def advance(self, tokens: torch.Tensor) -> None:
        self.state = self.next_state[self.state, tokens]

    def select(self, keep: torch.Tensor) -> None:
        self.state = self.state[keep]
