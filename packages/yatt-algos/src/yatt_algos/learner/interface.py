"""The learner interface both backends implement, as structural protocols (no base class to inherit).

Batches are an `Experience` or a dict of [B, T] tensors (see `packing.as_batch`); per-token outputs are
[B, T] aligned to `input_ids` (position t: the logprob of token t given the tokens before it; 0 at position 0
and at padding).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from yatt_algos.types import TrainStats

NamedTensors = list[tuple[str, torch.Tensor]]


@runtime_checkable
class PolicyLearner(Protocol):
    def compute_logprobs(self, batch: Any) -> torch.Tensor:
        """Logprobs [B, T] without grad."""
        ...

    def compute_logprobs_and_entropy(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, T], entropy [B, T]) without grad."""
        ...

    def update(self, experience: Any) -> TrainStats:
        """One PPO-style update: epochs x mini-batches, each one guarded optimizer step."""
        ...

    def export_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Buckets of (HF name, full tensor), one dtype each, for weight sync."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, counters and RNG: everything to resume bit-exactly."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class CriticLearner(Protocol):
    def compute_values(self, batch: Any) -> torch.Tensor:
        """Values [B, T] without grad."""
        ...

    def update(self, experience: Any) -> TrainStats: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
