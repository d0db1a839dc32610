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

import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from yatt_controller import checkpoint, local_calls
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
                local_calls.get(group.broadcast("save_checkpoint_shards", str(staging / prefix), background))
                sharded.append((prefix, group))
                continue
            parts = local_calls.get(group.broadcast("checkpoint_state"))
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
            for written in local_calls.get(group.broadcast("finish_checkpoint_shards")):
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
        """Load this controller's state and its groups' from a verified checkpoint; the next step. A
        checkpoint written by another number of controllers is re-split (`resplit`)."""
        manifest = checkpoint.verify(path)
        ranks = sorted(int(m[1]) for n in manifest.files if (m := CONTROLLER_FILE.fullmatch(n)))
        if ranks != list(range(len(ranks))):
            raise ValueError(f"{path}: its controller files are not controller-0 .. controller-N-1: {ranks}")
        states = [msgspec.msgpack.decode((path / f"controller-{r}.msgpack").read_bytes()) for r in ranks]
        state = resplit(states, self.plan.rank, self.plan.world_size, path)
        self.ctx.policy_version = state["policy_version"]
        self.sampler.load_state(state["sampler"])
        if state["rng"] is not None:
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
            if len(states) != self.plan.world_size and any(
                n.startswith(f"{prefix}-") for n in manifest.files
            ):
                raise ValueError(
                    f"{path} holds {prefix!r} as one file per worker, written by {len(states)} controllers; "
                    f"that state does not re-split over {self.plan.world_size}: resume with "
                    f"controller.num_controllers={len(states)}"
                )
            for worker in group.workers:
                part = f"{prefix}-{worker.group_dp_rank}.{worker.tp_rank}.bin"
                data = (path / part).read_bytes() if part in manifest.files else b""
                loads.append(worker.submit("load_checkpoint_state", (data,), {}))
        local_calls.get(loads)
        return manifest.step + 1


CONTROLLER_FILE = re.compile(r"controller-(\d+)\.msgpack")


def resplit(states: list[dict[str, Any]], rank: int, world: int, path: Any = "") -> dict[str, Any]:
    """The state controller `rank` of `world` resumes with, from the states the checkpoint's controllers
    saved (one each, in rank order). The same number: its own. Another number (the job's
    `controller.num_controllers` changed):
    - the data cursor is global: every controller's counts the global batches drawn in the epoch, and each
      controller takes its 1/world part of every global batch. Where the saved cursors agree (a step draws one
      global batch everywhere) the next global batches hold the same prompts as the uninterrupted run's,
      split over the new controllers; where they differ (DAPO's refills draw per controller) the furthest
      is taken: no prompt is drawn twice in an epoch, and the parts the lagging controllers had not drawn are
      skipped;
    - the policy version, the same everywhere, carries over;
    - the RNG and the step function's `ctx.state`: saved controller `rank`'s where it existed; a controller
      beyond the saved count starts from its own seeded RNG (None here) and saved controller 0's state,
      which carries what is the same on every controller (PPO's adaptive KL coefficient, DAPO's expansion
      ratio) and copies controller 0's own prompt queue (DAPO's buffer: its prompts may be drawn twice).
      The states of saved controllers beyond the new count are dropped (their buffered prompts skipped).
      An async run's batches in flight (`async_queue`) do not re-split: refused, naming the counts."""
    if len(states) == world:
        return states[rank]
    if not states:
        raise ValueError(f"{path} holds no controller state")
    versions = {s["policy_version"] for s in states}
    if len(versions) != 1:
        raise ValueError(f"{path}: its controllers saved different policy versions {sorted(versions)}")
    if any(s["state"].get("async_queue") for s in states):
        raise ValueError(
            f"{path} was written by {len(states)} controllers with async batches in flight "
            f"(algo.max_staleness > 0), which do not re-split over {world}: resume with "
            f"controller.num_controllers={len(states)}"
        )
    cursor = max((s["sampler"] for s in states), key=lambda c: (c["epoch"], c["step_in_epoch"]))
    own = states[rank] if rank < len(states) else None
    return {
        "policy_version": versions.pop(),
        "sampler": dict(cursor),
        "rng": own["rng"] if own is not None else None,
        "state": (own or states[0])["state"],
        "reports": own.get("reports", []) if own is not None else [],
    }


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
