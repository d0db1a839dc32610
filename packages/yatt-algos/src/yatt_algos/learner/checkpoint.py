"""Learner checkpoints: RNG state capture and restore, and atomic files.

A learner's `state_dict()` is a nested dict of tensors and plain Python values (model, optimizer, scheduler,
step counters, RNG), so it saves with `torch.save` and loads with `torch.load(weights_only=True)`: nothing is
unpickled but tensors and containers. Files are written to a temporary name in the same folder and renamed,
so a half-written checkpoint is never found under the real name.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """The RNG streams training draws from: Python's, torch's CPU generator and every CUDA device's."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured. Raises ValueError if a stream is missing."""
    for key in ("python", "torch"):
        if key not in state:
            raise ValueError(f"rng state has no {key!r} entry (keys: {sorted(state)})")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # a loaded tuple may come back as a list
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def snapshot(state: Any) -> Any:
    """A copy of nested dicts, lists and tuples in which every tensor is cloned (detached), so the result does
    not change when training goes on, and a learner loading it shares no storage with the source (torch's
    optimizer `load_state_dict` keeps the given tensors when dtype and device already fit)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(snapshot(v) for v in state)
    return state


STATE_KEYS = ("model", "optimizer", "scheduler", "num_steps", "num_skipped_total", "rng")


def learner_state(
    engine: Any, model_state: dict[str, Any], optimizer_state: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint layout both backends write: model, optimizer, scheduler, counters and RNG (a snapshot)."""
    return snapshot(
        {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": engine.scheduler.state_dict() if engine.scheduler else {},
            "num_steps": engine.num_steps,
            "num_skipped_total": engine.num_skipped_total,
            "rng": rng_state(),
        }
    )


def check_learner_state(state: dict[str, Any]) -> None:
    """ValueError naming the first missing entry of a learner checkpoint."""
    for key in STATE_KEYS:
        if key not in state:
            raise ValueError(f"learner state has no {key!r} entry (keys: {sorted(state)})")


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write `state` to `path` atomically (temporary file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a file written by `save_checkpoint` onto the CPU, tensors and containers only."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=True)
