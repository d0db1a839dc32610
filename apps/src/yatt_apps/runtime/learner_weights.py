"""What a learner rank serves a weight push: the live weights (DDP), or the tensors it holds gathered (FSDP2,
Megatron), one bucket at a time when the push streams (`phases.sync_weights`).

Under FSDP2 and Megatron tensor parallel the export is a collective over every learner rank, so a rank cannot
gather when the push asks: the driver has every rank gather together first. Streamed, each call of
`next_bucket` frees the bucket held and gathers the next, so a rank holds one bucket of unsharded weights
beside its shards (measured by `benchmarks/bench_checkpoint.py`, key `peak_extra_mib_over_model_mib`).
"""

from __future__ import annotations

from typing import Any


class LearnerWeights:
    """What a learner rank serves a weight push (`named_weights`): under DDP the live weights; under FSDP2 and
    Megatron, whose export is a collective that every rank runs together, the tensors this rank holds
    gathered: one bucket of a streamed push (`next_bucket`) or the whole model (`gather_all`)."""

    def __init__(self, learner: Any, backend: str) -> None:
        self.learner, self.backend = learner, backend
        self._gathered: list | None = None
        self._stream: Any = None  # the export in progress of a streamed push
        self.peak_bytes = 0  # the most gathered bytes held at once so far

    def gather_all(self) -> int:
        """Run the whole collective export on this rank (FSDP2 all-gathers its shards, Megatron its TP shards)
        and keep the full HF-named tensors for the next push; DDP needs no gather. Returns the bytes held."""
        self.release()
        if self.backend == "ddp":
            return 0
        self._gathered = [pair for bucket in self.learner.export_weights(64 << 20) for pair in bucket]
        return self._hold()

    def next_bucket(self, bucket_bytes: int) -> int:
        """One step of a streamed push, every learner rank together: free the bucket held, gather the next
        bucket (at most `bucket_bytes`, a larger tensor alone) of this push's export (the first call starts
        it) and hold it. Returns its bytes; 0 when the export is done, and at once under DDP (nothing to
        gather: the push reads the live weights)."""
        self._gathered = None  # freed before the next is gathered
        if self.backend == "ddp":
            return 0
        if self._stream is None:
            self._stream = iter(self.learner.export_weights(bucket_bytes))
        bucket = next(self._stream, None)
        if bucket is None:
            self._stream = None
            return 0
        self._gathered = bucket
        return self._hold()

    def _hold(self) -> int:
        assert self._gathered is not None
        held = sum(t.numel() * t.element_size() for _, t in self._gathered)
        self.peak_bytes = max(self.peak_bytes, held)
        return held

    def release(self) -> None:
        """Drop the gathered tensors and any streamed export left unfinished (the weights change next)."""
        self._gathered = self._stream = None

    def named_weights(self) -> Any:
        if self._gathered is not None:
            yield from self._gathered
            return
        if self.backend != "ddp":
            raise RuntimeError(
                f"learner.backend={self.backend!r}: call gather_weights (or next_weight_bucket) on every "
                "learner rank before a weight push (its export is a collective)"
            )
        for bucket in self.learner.export_weights(64 << 20):
            yield from bucket
