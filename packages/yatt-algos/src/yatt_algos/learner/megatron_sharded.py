"""Sharded checkpoints of the Megatron-Core learner with Megatron's distributed checkpointing: each TP/PP rank
writes its own part, and a checkpoint loads at another TP/PP size.

`megatron.core.dist_checkpointing` saves the model's `sharded_state_dict()`: every parameter as a
`ShardedTensor`, the rank's slice of one global tensor with its global offsets (tensor-parallel splits, the
pipeline stage's layers at their global layer numbers, the fused gate/up of SwiGLU split by a factory so that
each half reshards on its own). The optimizer's moments travel as tensors of the same layout
(`optim_state_to_sharding_state`, keys `optimizer.state.exp_avg.<param>`). Its torch_dist backend is
`torch.distributed.checkpoint` underneath, over the default process group (gloo or NCCL); a load reads, for
each tensor of this rank's own layout, the overlapping parts of the saved ones, so TP = 2 saved loads at
TP = 1 and a pipeline of 2 stages loads as 1.

The folder holds Megatron's files (`metadata.json`, `common.pt`, DCP's `.metadata`: rank 0; `__R_0.distcp`:
rank R's slices) and `extra-R.pt` per rank: scheduler, counters, the optimizer's step count (a scalar torch's
AdamW keeps per parameter, the same for all) and RNG, `torch.save`d. Saves are synchronous.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from yatt_algos.learner import checkpoint
from yatt_algos.learner.sharded import FileEntries, file_entry

MEGATRON_METADATA = "metadata.json"  # what dist_checkpointing writes last, on rank 0


def is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MEGATRON_METADATA).is_file()


def _sharded_state(learner: Any) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} of this rank as Megatron's sharded state dicts. Adam's `step` (a
    scalar, not a tensor of the parameter's shape) is left out: `extra` carries it."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model = learner.model.sharded_state_dict()
    if learner.optimizer is None:
        return {"model": model}
    _ensure_adam_state(learner.optimizer)
    optim = learner.optimizer.state_dict()
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    optim_state_to_sharding_state(
        optim, get_param_id_to_sharded_param_map(model, params), exclude_keys=("step",)
    )
    return {"model": model, "optimizer": optim}


def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state for every parameter that has none yet, as its first step would make it (zero moments,
    step 0): a save before the first update, and the template of a load, then hold every tensor."""
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ValueError(f"Megatron sharded checkpoints save AdamW's state, not {type(optimizer).__name__}'s")
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's own
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {
                    "step": torch.zeros((), dtype=scalar),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def _adam_step(learner: Any) -> float:
    """The optimizer's step count (every parameter's is the same: one optimizer step updates them all)."""
    if learner.optimizer is None:
        return 0.0
    steps = [float(s["step"]) for s in learner.optimizer.state.values() if "step" in s]
    return steps[0] if steps else 0.0


def _own_files(path: Path, rank: int) -> list[str]:
    """The files rank `rank` wrote: its DCP data and extra state; rank 0 also every file no rank numbers."""
    numbered = re.compile(r"^(__\d+_\d+\.distcp|extra-\d+\.pt)$")
    names = [p.name for p in path.iterdir() if p.is_file()]
    mine = [n for n in names if n.startswith(f"__{rank}_") or n == f"extra-{rank}.pt"]
    return sorted(mine + ([n for n in names if not numbered.match(n)] if rank == 0 else []))


def save(learner: Any, path: str | Path) -> FileEntries:
    """Write this rank's part of a checkpoint into folder `path` (a collective over the default process
    group: every TP, PP and DP rank calls it with the same `path`). Returns {file: (sha256, size)} of the
    files this rank wrote."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    extra = {
        "scheduler": learner.scheduler.state_dict() if learner.scheduler else {},
        "num_steps": learner.num_steps,
        "num_skipped_total": learner.num_skipped_total,
        "adam_step": _adam_step(learner),
        "rng": checkpoint.rng_state(),
    }
    dist_checkpointing.save(_sharded_state(learner), str(path))  # into an empty folder (it checks)
    checkpoint.save_checkpoint(extra, path / f"extra-{rank}.pt")
    dist.barrier()  # rank 0's metadata files are written before it lists its files
    return {name: file_entry(path / name) for name in _own_files(path, rank)}


def load(learner: Any, path: str | Path) -> None:
    """Load a folder `save` wrote, at this learner's own TP/PP layout (a collective)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not is_megatron_checkpoint(path):
        raise ValueError(f"{path}: no {MEGATRON_METADATA}, not a Megatron distributed checkpoint")
    loaded = dist_checkpointing.load(_sharded_state(learner), str(path))
    missing, unexpected = learner.model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{path}: the model does not fit: missing {missing}, unexpected {unexpected}")
    extra_file = path / f"extra-{dist.get_rank()}.pt"
    extra = checkpoint.load_checkpoint(extra_file if extra_file.is_file() else path / "extra-0.pt")
    if learner.optimizer is not None:
        optim = loaded["optimizer"]
        for state in optim["state"].values():
            state["step"] = torch.tensor(
                float(extra["adam_step"]), dtype=state.get("step", torch.zeros(())).dtype
            )
        learner.optimizer.load_state_dict(optim)
    if learner.scheduler is not None:
        learner.scheduler.load_state_dict(extra["scheduler"])
    learner.num_steps, learner.num_skipped_total = int(extra["num_steps"]), int(extra["num_skipped_total"])
    checkpoint.set_rng_state(extra["rng"])
