"""A deterministic, resumable shard of the dataset for each controller.

Every step consumes one global batch: a contiguous slice of the epoch's permutation (seeded by `seed` and the
epoch). Controller r of W takes the r-th of W equal parts of that slice, so the single controller (all parts)
sees exactly the union of what W parallel controllers see, in rank order. The cursor is (epoch, step in
epoch); the last partial batch of an epoch is dropped. Only indices travel: each controller loads its own rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class ShardSampler:
    def __init__(
        self, num_items: int, batch_size: int, *, seed: int, num_shards: int = 1, shards: Sequence[int] = (0,)
    ) -> None:
        if batch_size < 1 or num_shards < 1:
            raise ValueError(f"batch_size and num_shards must be >= 1, got {batch_size} and {num_shards}")
        if batch_size % num_shards:
            raise ValueError(f"batch_size {batch_size} must divide evenly over {num_shards} controllers")
        if num_items < batch_size:
            raise ValueError(f"the dataset has {num_items} rows, fewer than one batch of {batch_size}")
        if not shards or any(not 0 <= s < num_shards for s in shards):
            raise ValueError(f"shards must be in [0, {num_shards}), got {list(shards)}")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.num_shards, self.shards = num_shards, list(shards)
        self.epoch, self.step_in_epoch = 0, 0
        self._perm: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    def _permutation(self) -> list[int]:
        if self._perm is None or self._perm[0] != self.epoch:
            order = list(range(self.num_items))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._perm = (self.epoch, order)
        return self._perm[1]

    def next(self) -> list[int]:
        """The indices of this controller's part of the next global batch."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        perm, part = self._permutation(), self.batch_size // self.num_shards
        start = self.step_in_epoch * self.batch_size
        self.step_in_epoch += 1
        return [i for s in self.shards for i in perm[start + s * part : start + (s + 1) * part]]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
