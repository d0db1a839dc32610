"""Sharded learner checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own shards.

A checkpoint folder written by `save` holds:
- `.metadata` (rank 0): DCP's global layout: every tensor's full shape, dtype and which file holds which chunk;
- `__R_0.distcp` (rank R): rank R's chunks of the model and optimizer state. Under FSDP2 a rank writes only
  its own shards (about 1 / world of the state); under DDP, or one process, the tensors are replicated and
  DCP's planner keeps one copy of each in all (no rank writes a tensor another rank writes);
- `extra-R.pt` (rank R): the small per-rank state, `torch.save`d: scheduler, step counters and RNG.

`load` reads into this learner's own (sharded) state dict, so DCP reshards: a checkpoint written by N ranks
loads on M. Scheduler and counters are the same on every rank; rank r takes the RNG of saved rank r when
there was one, else saved rank 0's (a different world size draws other batches anyway).

`save(..., background=True)` copies the state to host memory (DCP's staging) and returns; the files are
written by a thread while training goes on, on a process group of its own (gloo), so its collectives never
interleave with the training group's. `PendingSave.wait()` returns the files this rank wrote with their
sha256 and size, for the caller's manifest.

`iter_checkpoint_tensors` streams the model's full tensors out of a folder a bucket at a time, in one process
and without a process group: what export reads, never holding the whole model twice.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from yatt_algos.learner import checkpoint

METADATA = ".metadata"
# rank -> (relative path, (sha256 hex, size)) of the files it wrote
FileEntries = dict[str, tuple[str, int]]


# DCP's warning on every save or load without a process group; here that is the intent (one learner process),
# and a background save emits it on its writer thread, after any `catch_warnings` around the call has exited
SINGLE_PROCESS_WARNING = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a "
    r"single process"
)


def _single_process(no_dist: bool) -> None:
    """Before a save or load without a process group: silence DCP's single-process warning in this process,
    by a filter for that one message (`filterwarnings` replaces an identical filter, so repeated saves add
    nothing), which also covers the background writer's thread."""
    if no_dist:
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)


def file_entry(path: Path) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read in 16 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def own_files(path: Path, rank: int) -> list[str]:
    """The files of `path` that rank `rank` wrote: its DCP data files and extra state (and `.metadata` for
    rank 0)."""
    names = [p.name for p in path.iterdir() if p.is_file()]
    mine = [n for n in names if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    mine.append(f"extra-{rank}.pt")
    return sorted(mine + ([METADATA] if rank == 0 else []))


class PendingSave:
    """A save in flight (or done): `wait()` blocks until this rank's files are on disk and returns them."""

    def __init__(self, path: Path, rank: int, future: Future | None, extra: dict[str, Any]) -> None:
        self.path, self.rank = path, rank
        # the small per-rank file, then the hashes, on a background thread of their own, after DCP's write
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yatt-ckpt")
        self._entries = self._pool.submit(self._finish, future, extra)

    def _finish(self, future: Future | None, extra: dict[str, Any]) -> FileEntries:
        checkpoint.save_checkpoint(extra, self.path / f"extra-{self.rank}.pt")
        if future is not None:
            future.result()
        entries = {}
        for name in own_files(self.path, self.rank):
            _fsync(self.path / name)  # DCP's writer fsyncs its data files; .metadata and extra here
            entries[name] = file_entry(self.path / name)
        return entries

    def done(self) -> bool:
        return self._entries.done()

    def wait(self) -> FileEntries:
        try:
            return self._entries.result()
        finally:
            self._pool.shutdown(wait=False)


class ShardedState:
    """DCP saves and loads of one engine (a `TorchEngine`: model, optimizer, scheduler, counters). Holds the
    gloo process group its saves run on, made on first use (a collective of every rank of the default group,
    which the engine's ranks are)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._group: dist.ProcessGroup | None = None
        self.pending: PendingSave | None = None

    @property
    def rank(self) -> int:
        group = self.engine.group
        return dist.get_rank(group) if group is not None else 0

    def _process_group(self) -> dist.ProcessGroup | None:
        if self.engine.group is None:
            return None
        if self._group is None:
            ranks = dist.get_process_group_ranks(self.engine.group)
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        return self._group

    def tensors(self) -> dict[str, Any]:
        """{"model": ..., "optim": ...} of this rank: DTensor shards under FSDP2, plain tensors otherwise
        (FQNs without DDP's `module.`; the optimizer keyed by parameter FQN, as DCP needs for resharding)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        engine = self.engine
        optims = [engine.optimizer] if engine.optimizer else []
        model_state, optim_state = get_state_dict(
            engine.model, optims, options=StateDictOptions(full_state_dict=False)
        )
        return {"model": model_state, "optim": optim_state if optims else {}}

    def extra(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "scheduler": engine.scheduler.state_dict() if engine.scheduler else {},
            "num_steps": engine.num_steps,
            "num_skipped_total": engine.num_skipped_total,
            "rng": checkpoint.rng_state(),
            "world_size": engine.world_size,
        }

    def save(self, path: str | os.PathLike, *, background: bool = False) -> PendingSave:
        """Write this rank's part of a checkpoint into folder `path` (a collective: every rank calls it with
        the same `path`). A save still in flight is waited for first."""
        import torch.distributed.checkpoint as dcp

        if self.pending is not None:
            self.pending.wait()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        group, rank = self._process_group(), self.rank
        extra = checkpoint.snapshot(self.extra())  # now: the files are written later
        writer = dcp.FileSystemWriter(path, thread_count=1, sync_files=True)
        state, no_dist = self.tensors(), group is None
        future: Future | None = None
        _single_process(no_dist)
        if background:
            started = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
            assert isinstance(started, Future), "a thread async save returns a Future"
            future = started
        else:
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
        self.pending = PendingSave(path, rank, future, extra)
        return self.pending

    def wait(self) -> FileEntries:
        """The files of the last save (waiting for it to be written); {} when none was made."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else {}

    def load(self, path: str | os.PathLike) -> None:
        """Load a folder written by `save` at any world size (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        path = Path(path)
        if not (path / METADATA).is_file():
            raise ValueError(f"{path}: no {METADATA}, not a sharded (DCP) learner checkpoint")
        self.wait()
        engine, group = self.engine, self._process_group()
        state = self.tensors()  # the template: this rank's shards at the current world size
        _single_process(group is None)
        reader = dcp.FileSystemReader(path)
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=group is None)
        optims = [engine.optimizer] if engine.optimizer else []
        set_state_dict(
            engine.model,
            optims,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"] if optims else {},
            options=StateDictOptions(full_state_dict=False),
        )
        extra_file = path / f"extra-{self.rank}.pt"
        extra = checkpoint.load_checkpoint(extra_file if extra_file.is_file() else path / "extra-0.pt")
        if engine.scheduler:
            engine.scheduler.load_state_dict(extra["scheduler"])
        engine.num_steps, engine.num_skipped_total = int(extra["num_steps"]), int(extra["num_skipped_total"])
        checkpoint.set_rng_state(extra["rng"])


def model_tensor_specs(path: str | os.PathLike) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(model FQN, full shape, dtype) of every model tensor in a DCP learner checkpoint, in saved order."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(path).read_metadata()
    out = []
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            out.append((key.removeprefix("model."), item.size, item.properties.dtype))
    return out


def iter_checkpoint_tensors(
    path: str | os.PathLike, bucket_bytes: int = 256 << 20
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (model FQN, full tensor) read from a DCP learner checkpoint, at most `bucket_bytes` each
    (a larger tensor alone), in one process: only the current bucket is in memory."""
    import torch.distributed.checkpoint as dcp

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    specs = model_tensor_specs(path)
    if not specs:
        raise ValueError(f"{path}: the checkpoint holds no model tensors")
    start = 0
    while start < len(specs):
        end, size = start, 0
        while end < len(specs) and (end == start or size + _nbytes(specs[end]) <= bucket_bytes):
            size += _nbytes(specs[end])
            end += 1
        bucket = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in specs[start:end]}
        _single_process(True)
        dcp.load({"model": bucket}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        yield list(bucket.items())
        start = end


def _nbytes(spec: tuple[str, torch.Size, torch.dtype]) -> int:
    _, shape, dtype = spec
    return shape.numel() * dtype.itemsize


class LearnerFiles:
    """The sharded checkpoint protocol of a worker that hosts a learner (what
    `yatt_controller.controller_checkpoint` calls `save/finish/load_checkpoint_shards`): a learner with
    `save_shards` writes its own part (torch: DCP shards, in the background when asked; Megatron: its TP/PP
    slices through Megatron's distributed checkpointing, `megatron_sharded`), and either loads at another
    world size or layout. A learner without it writes its own rank's whole `state_dict()` as `state-R.pt`,
    R its rank in the default process group, and loads it back at the same layout (what Megatron learners
    wrote before, still read)."""

    def __init__(self) -> None:
        self._written: FileEntries = {}

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def save(self, learner: Any, folder: str, background: bool) -> None:
        if hasattr(learner, "save_shards"):
            learner.save_shards(folder, background=background)
            return
        path = Path(folder) / f"state-{self._rank()}.pt"
        checkpoint.save_checkpoint(learner.state_dict(), path)
        self._written = {path.name: file_entry(path)}

    def finish(self, learner: Any) -> FileEntries:
        if hasattr(learner, "wait_shards"):
            return learner.wait_shards()
        written, self._written = self._written, {}
        return written

    def load(self, learner: Any, folder: str) -> None:
        if (Path(folder) / METADATA).is_file():
            learner.load_shards(folder)
            return
        path = Path(folder) / f"state-{self._rank()}.pt"
        if not path.is_file():
            raise ValueError(f"{folder}: neither a DCP checkpoint ({METADATA}) nor this rank's {path.name}")
        learner.load_state_dict(checkpoint.load_checkpoint(path))
