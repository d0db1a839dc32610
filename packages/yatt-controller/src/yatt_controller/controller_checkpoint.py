"""A controller's part of a checkpoint: its own state (policy version, data cursor, RNG, the step function's
`ctx.state`, the reports the driver had not logged) and its learner ranks' and checkpointed groups' state.

`ControllerCheckpoint.save(step)` is collective: rank 0 opens the staging directory, every controller writes
its files, rank 0 writes the manifest and renames (`checkpoint.py`: atomic). `restore(path)` loads them back
and returns the step to run next; `saved_reports(path)` reads the reports a checkpoint carries.

Two worker protocols. A worker returns its state as bytes (`checkpoint_state() -> bytes`,
`load_checkpoint_state(bytes)`), written by its controller as `PREFIX-DP.TP.bin`. Or its class has
`save_checkpoint_shards(folder, background)`, `finish_checkpoint_shards() -> {name: (sha256, size)}` and
`load_checkpoint_shards(folder)` (a sharded learner, preferred when present): every worker of the group writes
its own files into `PREFIX/` of the staging directory itself, all together (a collective), and says what it
wrote. With `background` (`ControllerSpec.checkpoint_async`) the save returns once the state is staged in
host memory and the files are written while the next step runs: `settle()` (after that step, before the next
save, and when the run ends) waits for them and only then commits, so a checkpoint is complete only when its
manifest lands, and a crash before that leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import ray

from yatt_controller import checkpoint
from yatt_controller.types import StepReport

if TYPE_CHECKING:
    from yatt_controller.controller import ControllerPlan, StepContext
    from yatt_controller.data import ShardSampler


class ControllerCheckpoint:
    """Writes and reads one controller's checkpoint files. `lock` guards the unlogged reports (heartbeats
    run on another thread)."""

    def __init__(
        self, plan: ControllerPlan, ctx: StepContext, sampler: ShardSampler, lock: threading.Lock
    ) -> None:
        self.plan, self.ctx, self.sampler, self._lock = plan, ctx, sampler, lock
        # finished and not yet logged by the driver (its heartbeat says how far it has logged): a checkpoint
        # carries them, so a run resumed after the driver died logs the steps it had not (saved_reports)
        self._unlogged: list[StepReport] = []
        # a save whose sharded groups may still be writing: (step, policy version then, files written so far,
        # the sharded groups)
        self._pending: tuple[int, int, dict[str, tuple[str, int]], list[tuple[str, Any]]] | None = None

    @property
    def pending(self) -> bool:
        """Whether a save waits for `settle` to commit it."""
        return self._pending is not None

    def unlogged(self, report: StepReport) -> None:
        with self._lock:
            self._unlogged.append(report)

    def logged(self, through: int) -> None:
        """The driver logged every step up to `through` (the caller holds the lock)."""
        self._unlogged = [r for r in self._unlogged if r.step > through]

    def _state_bytes(self) -> bytes:
        version, internal, gauss = self.ctx.rng.getstate()
        state = {
            "policy_version": self.ctx.policy_version,
            "sampler": self.sampler.state(),
            "rng": [version, list(internal), gauss],
            "state": self.ctx.state,
        }
        with self._lock:  # this controller's reports the driver may not have logged, this step's included
            state["reports"] = list(self._unlogged)
        return msgspec.msgpack.encode(state)

    def save(self, step: int) -> None:
        """Rank 0 opens the staging directory, every controller writes its part (its own state and its
        learner ranks'); sharded groups write theirs (in the background when the plan says so); then, once
        they are written (`settle`), rank 0 writes the manifest and renames."""
        self.settle()  # the previous save commits first
        root, col, rank = self.plan.checkpoint_dir, self.ctx.collective, self.plan.rank
        assert root is not None, "save needs the plan's checkpoint_dir"
        if rank == 0:
            checkpoint.begin(root, step)
        col.barrier()
        staging = checkpoint.staging_dir(root, step)
        name = f"controller-{rank}.msgpack"
        files = {name: checkpoint.write_file(staging, name, self._state_bytes())}
        sharded, background = [], self.plan.checkpoint_async
        for prefix, group in self.plan.stateful():
            if writes_shards(group):
                ray.get(group.broadcast("save_checkpoint_shards", str(staging / prefix), background))
                sharded.append((prefix, group))
                continue
            parts = ray.get(group.broadcast("checkpoint_state"))
            for worker, data in zip(group.workers, parts, strict=True):
                if data:
                    part = f"{prefix}-{worker.group_dp_rank}.{worker.tp_rank}.bin"
                    files[part] = checkpoint.write_file(staging, part, data)
        self._pending = (step, self.ctx.policy_version, files, sharded)
        if not background:
            self.settle()

    def settle(self) -> None:
        """Commit the save in flight, if any, after its sharded groups finished writing (collective: every
        controller calls it at the same point of the loop)."""
        if self._pending is None:
            return
        step, version, files, sharded = self._pending
        self._pending = None
        for prefix, group in sharded:
            for written in ray.get(group.broadcast("finish_checkpoint_shards")):
                files.update({f"{prefix}/{name}": tuple(entry) for name, entry in written.items()})
        col, root = self.ctx.collective, self.plan.checkpoint_dir
        everything = {k: v for part in col.all_gather(files) for k, v in part.items()}
        if self.plan.rank == 0:
            assert root is not None, "a save needs the plan's checkpoint_dir"
            checkpoint.commit(
                root,
                step,
                everything,
                policy_version=version,
                keep=self.plan.keep_checkpoints,
            )
        col.barrier()

    def restore(self, path: Path) -> int:
        """Load this controller's state and its groups' from a verified checkpoint; the next step."""
        manifest = checkpoint.verify(path)
        name = f"controller-{self.plan.rank}.msgpack"
        if name not in manifest.files:
            raise ValueError(f"{path} holds no {name}: it was written by a different number of controllers")
        state = msgspec.msgpack.decode((path / name).read_bytes())
        self.ctx.policy_version = state["policy_version"]
        self.sampler.load_state(state["sampler"])
        version, internal, gauss = state["rng"]
        self.ctx.rng.setstate((version, tuple(internal), gauss))
        self.ctx.state = state["state"]
        loads: list[Any] = []
        for prefix, group in self.plan.stateful():
            if any(name.startswith(f"{prefix}/") for name in manifest.files):
                if not writes_shards(group):
                    raise ValueError(
                        f"{path} holds {prefix!r} as sharded files ({prefix}/), and its workers "
                        f"({group.role!r}) have no load_checkpoint_shards"
                    )
                loads += group.broadcast("load_checkpoint_shards", str(path / prefix))
                continue
            for worker in group.workers:
                part = f"{prefix}-{worker.group_dp_rank}.{worker.tp_rank}.bin"
                data = (path / part).read_bytes() if part in manifest.files else b""
                loads.append(worker.submit("load_checkpoint_state", (data,), {}))
        ray.get(loads)
        return manifest.step + 1


def writes_shards(group: Any) -> bool:
    """Whether a group's hosted class has the sharded protocol (`save_checkpoint_shards` and the rest)."""
    hosted = group.spawn.hosted if group.spawn is not None else None
    methods = ("save_checkpoint_shards", "finish_checkpoint_shards", "load_checkpoint_shards")
    return hosted is not None and all(callable(getattr(hosted, m, None)) for m in methods)


def saved_reports(path: str | Path) -> list[StepReport]:
    """The step reports a verified checkpoint carries: each controller's reports that the driver had not
    logged (as far as its last heartbeat told) when the checkpoint was written, this checkpoint's step
    included. A run resumed from it logs the steps of these that its log lacks (checkpoints written before
    reports were saved carry none)."""
    path = Path(path)
    manifest = checkpoint.verify(path)
    out: list[StepReport] = []
    for name in sorted(manifest.files):
        if name.startswith("controller-") and name.endswith(".msgpack"):
            state = msgspec.msgpack.decode((path / name).read_bytes())
            out += [msgspec.convert(r, StepReport) for r in state.get("reports", [])]
    return out
