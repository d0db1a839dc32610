"""What a learner rank serves a weight push: the live weights (DDP), or the tensors it holds gathered (FSDP2,
Megatron), one bucket at a time when the push streams (`phases.sync_weights`).

Under FSDP2 and Megatron tensor parallel the export is a collective over every learner rank, so a rank cannot
gather when the push asks: the driver has every rank gather together first. Streamed, each call of
`next_bucket` frees the bucket held and gathers the next, so a rank holds one bucket of unsharded weights
beside its shards (measured by `benchmarks/bench_checkpoint.py`, key `peak_extra_mib_over_model_mib`).

A LoRA learner (`learner.lora_rank > 0`) syncs adapters only (`yatt_algos.learner.lora_export`): its first
export holds the frozen base weights (unmerged) and then the adapter factors; every later one the adapter
factors alone, in buckets of their own, which the engines apply onto the base they hold
(`yatt_rollout.adapters.load_push`). Its exports are always held (under DDP too: the factors are small, the
base tensors views), so which export is the first is this object's state, not the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def push_reads_gathered(backend: str, lora: bool) -> bool:
    """Whether a weight push reads tensors the learner ranks gather for it first (FSDP2, Megatron, and every
    LoRA learner); else it reads DDP's live weights and the ranks have nothing to do for it."""
    return backend != "ddp" or lora


class LearnerWeights:
    """What a learner rank serves a weight push (`named_weights`): under DDP the live weights; under FSDP2 and
    Megatron, whose export is a collective that every rank runs together, the tensors this rank holds
    gathered: one bucket of a streamed push (`next_bucket`) or the whole model (`gather_all`). A LoRA
    learner's pushes hold its base once, then its adapters only."""

    def __init__(self, learner: Any, backend: str) -> None:
        self.learner, self.backend = learner, backend
        self._gathered: list | None = None
        self._stream: Any = None  # the export in progress of a streamed push
        self.peak_bytes = 0  # the most gathered bytes held at once so far
        self.lora = bool(getattr(getattr(learner, "engine", None), "lora", False))  # adapter-only sync
        self.base_sent = False  # LoRA: a whole export (base included) was taken

    def _export(self, bucket_bytes: int) -> Iterator[list]:
        if self.lora:  # the base weights travel with the first export only
            return self.learner.engine.export_lora(bucket_bytes, base=not self.base_sent)
        return self.learner.export_weights(bucket_bytes)

    def _holds(self) -> bool:
        """Whether a push reads held tensors (else DDP's live weights, read when the push asks)."""
        return push_reads_gathered(self.backend, self.lora)

    def gather_all(self) -> int:
        """Run the whole collective export on this rank (FSDP2 all-gathers its shards, Megatron its TP shards)
        and keep the full HF-named tensors for the next push; DDP needs no gather. Returns the bytes held."""
        self.release()
        if not self._holds():
            return 0
        self._gathered = [pair for bucket in self._export(64 << 20) for pair in bucket]
        self.base_sent = self.lora
        return self._hold()

    def next_bucket(self, bucket_bytes: int) -> int:
        """One step of a streamed push, every learner rank together: free the bucket held, gather the next
        bucket (at most `bucket_bytes`, a larger tensor alone) of this push's export (the first call starts
        it) and hold it. Returns its bytes; 0 when the export is done, and at once under DDP (nothing to
        gather: the push reads the live weights)."""
        self._gathered = None  # freed before the next is gathered
        if not self._holds():
            return 0
        if self._stream is None:
            self._stream = iter(self._export(bucket_bytes))
        bucket = next(self._stream, None)
        if bucket is None:
            self._stream = None
            self.base_sent = self.lora
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
        if self.lora:  # a push outside the step's loop (a replaced replica): its engine, built from the
            for bucket in self.learner.engine.export_lora(64 << 20, base=False):  # model folder, has the base
                yield from bucket
            return
        if self.backend != "ddp":
            raise RuntimeError(
                f"learner.backend={self.backend!r}: call gather_weights (or next_weight_bucket) on every "
                "learner rank before a weight push (its export is a collective)"
            )
        for bucket in self.learner.export_weights(64 << 20):
            yield from bucket
