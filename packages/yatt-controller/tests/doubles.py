"""Test doubles for the runtime tests, named as such: a scripted engine and a counting learner.

They stand in for a rollout engine and a learner so that the runtime's own behaviour (dispatch, routing,
driver bytes, checkpoints, health) is checked without model imports; `test_tiny_models.py` runs the same
runtime with real tiny transformers models. Faults are scripted through marker files so that each fires once
per test, even across restarts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec


def _fire_once(marker: str | None) -> bool:
    """True the first time a fault is reached (creates the marker file), False afterwards."""
    if marker is None or Path(marker).exists():
        return False
    Path(marker).write_text("fired")
    return True


class ScriptedEngine:
    """A rollout double: each prompt (an int) becomes one sample with `media_bytes` of generated media."""

    def __init__(
        self,
        media_bytes: int = 0,
        crash_at_call: int = -1,
        hang_at_call: int = -1,
        marker: str | None = None,
        version: int = 0,
    ):
        self.media_bytes, self.crash_at_call, self.hang_at_call = media_bytes, crash_at_call, hang_at_call
        self.marker, self.calls, self.version = marker, 0, version

    def generate(self, prompts: list[int]) -> list[dict]:
        call, self.calls = self.calls, self.calls + 1
        if call == self.crash_at_call and _fire_once(self.marker):
            os._exit(1)  # a real crash of this worker's process, mid-step
        if call == self.hang_at_call:
            time.sleep(3600)
        return [
            {
                "prompt": p,
                "x": 2 * p + 1,
                "version": self.version,
                "media": bytes([p % 256]) * self.media_bytes,
            }
            for p in prompts
        ]

    def blob(self, nbytes: int):
        import numpy as np

        return np.full(nbytes, 7, dtype=np.uint8)

    def hold(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def set_version(self, version: int) -> None:
        self.version = version

    def getpid(self) -> int:
        return os.getpid()


class CountingLearner:
    """A learner double: "trains" by adding up what it sees; its state is that running total."""

    def __init__(self, crash_in_checkpoint: int = -1, marker: str | None = None, worker_info=None):
        self.total, self.num_checkpoints = 0, 0
        self.crash_in_checkpoint, self.marker, self.info = crash_in_checkpoint, marker, worker_info

    def train(self, samples: list[dict]) -> float:
        self.total += sum(s["x"] for s in samples) + sum(len(s["media"]) for s in samples)
        return float(self.total)

    def identity(self, obj: object) -> tuple[int, int, str]:
        """This process, the id of the object it was given and the thread it runs on."""
        import threading

        return os.getpid(), id(obj), threading.current_thread().name

    def pid(self) -> int:
        return os.getpid()

    def checkpoint_state(self) -> bytes:
        self.num_checkpoints += 1
        if self.num_checkpoints == self.crash_in_checkpoint and _fire_once(self.marker):
            os._exit(1)  # dies in the middle of a checkpoint write
        return msgspec.msgpack.encode({"total": self.total, "rank": self.info.dp_rank})

    def load_checkpoint_state(self, data: bytes) -> None:
        state = msgspec.msgpack.decode(data)
        assert state["rank"] == self.info.dp_rank, "a learner rank loaded another rank's state"
        self.total = state["total"]

    def rank(self) -> tuple[int, int]:
        return self.info.dp_rank, self.info.dp_size

    def getpid(self) -> int:
        return os.getpid()

    def malloc_env(self) -> dict[str, str]:
        """The host process's glibc malloc settings, as it started with them."""
        return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


class ShardedCountingLearner(CountingLearner):
    """A learner double with the sharded checkpoint protocol: each rank writes its own file into the folder
    it is given, on a thread when `background` (it waits `write_s` first, as a long write would), and says
    what it wrote."""

    def __init__(self, write_s: float = 0.0, worker_info=None):
        super().__init__(worker_info=worker_info)
        self.write_s, self._writer = write_s, None

    def save_checkpoint_shards(self, folder: str, background: bool) -> None:
        import hashlib
        import threading
        import time
        from pathlib import Path

        data = msgspec.msgpack.encode({"total": self.total, "rank": self.info.dp_rank})  # staged now
        name = f"total-{self.info.dp_rank}.bin"

        def write() -> dict:
            time.sleep(self.write_s if background else 0.0)
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / name).write_bytes(data)
            return {name: (hashlib.sha256(data).hexdigest(), len(data))}

        self._writer = {"result": None}
        thread = threading.Thread(target=lambda: self._writer.update(result=write()))
        thread.start()
        self._writer["thread"] = thread
        if not background:
            thread.join()

    def finish_checkpoint_shards(self) -> dict:
        writer, self._writer = self._writer, None
        if writer is None:
            return {}
        writer["thread"].join()
        return writer["result"]

    def load_checkpoint_shards(self, folder: str) -> None:
        from pathlib import Path

        self.load_checkpoint_state((Path(folder) / f"total-{self.info.dp_rank}.bin").read_bytes())


def media_step(ctx, batch: list[int]) -> dict[str, float]:
    """One step: generate, check versions, train on this controller's share, all-reduce the counts."""
    with ctx.phase("rollout"):
        chunks = ctx.get(ctx.services["rollout"].scatter("generate", batch))
    samples = [s for chunk in chunks for s in chunk]
    ctx.check_versions([s["version"] for s in samples])
    with ctx.phase("train"):
        totals = ctx.get(ctx.learner.gather(ctx.learner.scatter("train", samples)))
    ctx.state["seen"] = ctx.state.get("seen", 0) + len(samples)
    signature = sum((k + 1) * row for k, row in enumerate(batch))  # order-sensitive: same batch, same order
    counts = ctx.all_reduce(
        {"num_samples": len(samples), "signature": signature, "learner_total": sum(totals)}
    )
    return {**counts, "seen": ctx.state["seen"], "draw": ctx.rng.random()}


def pid_step(ctx, batch: list[int]) -> dict[str, float]:
    """media_step, plus whether this controller runs in the process of its (first) learner rank, and whether
    its call there ran in process (`local_calls`: a `LocalRef`, on the host's own thread, and the rank got the
    caller's own list, not a copy)."""
    from yatt_controller import local_calls

    ref = ctx.learner.rank_zero("identity", batch)
    pid, object_id, thread = ctx.get(ref)
    here = local_calls.is_local(ref) and object_id == id(batch) and thread.startswith("host-here")
    counts = ctx.all_reduce({"n": float(os.getpid() == pid), "here": float(here)})
    return {**media_step(ctx, batch), "in_learner_process": counts["n"], "called_in_process": counts["here"]}


BLOB_BYTES = 10 * 2**20


def blob_step(ctx, batch: list[int]) -> dict[str, float]:
    """Fetches a 10 MiB array from a service with `local_calls.get` (`ray.get` that also takes a call run in
    process), not the runtime's `ctx.get`: the driver's ledger counts it as any library's fetch."""
    from yatt_controller import local_calls

    array = local_calls.get(ctx.services["rollout"].rank_zero("blob", BLOB_BYTES))
    return {"blob_bytes": float(array.nbytes), "num_samples": float(len(batch))}


def critic_step(ctx, batch: list[int]) -> dict[str, float]:
    """media_step, then a second stateful service ("critic", a CountingLearner) trains on the batch rows."""
    metrics = media_step(ctx, batch)
    critic = ctx.services["critic"]
    totals = ctx.get(critic.gather(critic.scatter("train", [{"x": row, "media": b""} for row in batch])))
    return {**metrics, "critic_total": ctx.all_reduce({"t": float(sum(totals))})["t"]}


def failing_step(ctx, batch: list[int]) -> dict[str, float]:
    """A step with a bug at step 1: an error of the job's own code, which no restart can fix."""
    if ctx.step == 1:
        raise ValueError(f"bad reward in row {batch[0]}")
    return {"num_samples": float(len(batch))}


class RowRecorder:
    """A learner double for `shard_rows`: records the rows each rank got and returns what it saw."""

    def __init__(self, worker_info=None):
        self.info, self.seen = worker_info, []

    def train_rows(self, batch: dict) -> dict:
        ids = list(batch["ids"])
        self.seen.append(ids)
        return {
            "dp_rank": self.info.dp_rank,
            "ids": ids,
            "tensor_rows": [float(x) for x in batch["feat"][:, 0].tolist()],
            "scale": batch["scale"],
            "other": batch["other"],
        }


def rows_step(ctx, batch: list[int]) -> dict[str, float]:
    """Train through `own_learner.shard_rows`: every learner rank of this controller's view gets its rows."""
    import torch

    payload = {
        "ids": list(batch),
        "feat": torch.tensor(batch, dtype=torch.float32).reshape(-1, 1).repeat(1, 3),  # [B, 3]
        "scale": 0.5,
        "other": [7, 8, 9],  # not B long: every rank gets it whole
    }
    metrics: dict[str, float] = {}
    for out in ctx.get(ctx.own_learner.shard_rows("train_rows", payload)):
        r = out["dp_rank"]
        assert out["tensor_rows"] == [float(i) for i in out["ids"]], "tensor rows and list rows disagree"
        assert out["scale"] == 0.5 and out["other"] == [7, 8, 9]
        metrics.update({f"rank{r}_n": len(out["ids"]), f"rank{r}_first": out["ids"][0]})
        metrics[f"rank{r}_sig"] = sum((k + 1) * v for k, v in enumerate(out["ids"]))
    return metrics


class WeightsDouble:
    """A weight holder double with real torch tensors, both sender (`named_weights`) and receiver
    (`load_weights`). It records the storage it was handed, so a test can tell an in-process hand-over (the
    sender's own storage) from a broadcast (a fresh buffer)."""

    def __init__(self, seed: int = 0, worker_info=None):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.weights = {
            "w": torch.randn(64, 32, generator=gen),  # 8192 bytes
            "b": torch.randn(32, generator=gen),  # 128 bytes
            "h": torch.randn(16, generator=gen).to(torch.float16),  # 32 bytes, a second dtype bucket
        }
        self.version, self.handed, self.refuse = -1, {}, ""

    def named_weights(self):
        return list(self.weights.items())

    def refuse_next_load(self, message: str) -> None:
        """The next `load_weights` raises ValueError(message) (a target that fails while a push lands)."""
        self.refuse = message

    def load_weights(self, named, version: int) -> None:
        if self.refuse:
            message, self.refuse = self.refuse, ""
            raise ValueError(message)
        self.handed = {name: t.data_ptr() for name, t in named}
        for name, tensor in named:
            self.weights[name].copy_(tensor)
        self.version = version

    def perturb(self, delta: float) -> None:
        for tensor in self.weights.values():
            tensor.add_(delta)

    def state(self) -> dict:
        return {
            "version": self.version,
            "pid": os.getpid(),
            "digest": {n: t.numpy().tobytes() for n, t in self.weights.items()},
            "own": {n: t.data_ptr() for n, t in self.weights.items()},
            "handed": self.handed,
        }


class SleepyStage:
    """A service double for streaming: `work` sleeps, then returns what it got with its host-side times."""

    def __init__(self, fail_on: int = -1):
        self.fail_on = fail_on

    def work(self, item: int, previous, seconds: float) -> dict:
        start = time.time()
        if item == self.fail_on:
            raise ValueError(f"bad item {item}")
        time.sleep(seconds)
        return {"item": item, "previous": previous, "pid": os.getpid(), "start": start, "end": time.time()}


class VersionedEngine(WeightsDouble):
    """A rollout double holding real tensors: each prompt becomes a sample stamped with its weights' version
    and the device it ran on."""

    def generate(self, prompts: list[int]) -> list[dict]:
        time.sleep(0.05)
        return [{"prompt": p, "version": self.version, "device": self.info.device} for p in prompts]

    def __init__(self, seed: int = 1, worker_info=None):
        super().__init__(seed)
        self.info = worker_info


class WeightsLearner(WeightsDouble):
    """A learner double: "training" on a chunk shifts every weight by its row count, so versions differ."""

    def train(self, chunk: dict) -> int:
        self.perturb(float(len(chunk["prompt"])))
        return len(chunk["prompt"])


class SlowJudge:
    """A judge double: scores samples after a fixed delay, and says on which device it ran."""

    def __init__(self, seconds: float = 0.3, worker_info=None):
        self.seconds, self.info = seconds, worker_info

    def judge(self, samples: list[dict]) -> list[dict]:
        time.sleep(self.seconds)
        return [{"score": float(s["prompt"] % 2), "device": self.info.device} for s in samples]


def move_step(ctx, batch: list[int]) -> dict[str, float]:
    """Generate, refuse stale samples, judge, train on every learner rank, push the next version."""
    with ctx.phase("rollout"):
        samples = [s for part in ctx.get(ctx.services["rollout"].scatter("generate", batch)) for s in part]
    ctx.check_versions([s["version"] for s in samples])
    with ctx.phase("reward"):
        scores = [s for part in ctx.get(ctx.services["reward"].scatter("judge", samples)) for s in part]
    with ctx.phase("train"):
        ctx.get(ctx.own_learner.shard_rows("train", {"prompt": [s["prompt"] for s in samples]}))
    rollout_devices = {s["device"] for s in samples}
    judge_devices = {s["device"] for s in scores}
    versions = [s["version"] for s in samples]
    seen = ctx.all_gather((sorted(rollout_devices), sorted(judge_devices), min(versions), max(versions)))
    ctx.sync_weights()
    sums = ctx.all_reduce({"num_samples": len(samples)})
    return {
        **sums,
        "rollout_devices": float(len({d for part in seen for d in part[0]})),
        "judge_devices": float(len({d for part in seen for d in part[1]})),
        "min_version": float(min(part[2] for part in seen)),
        "max_version": float(max(part[3] for part in seen)),
    }


# The GCS address of the Ray session the test modules of one test process share (the workspace conftest.py
# leaves it running after a module; apps/tests/conftest.py sets it for the apps tests' session).
SHARED_RAY = "YATT_TESTS_SHARED_RAY"


DEVICES = 16  # logical GPUs of the session: room for every module's plans


def start_ray(*by_value) -> None:
    """A local Ray for one test module (logical GPUs as devices), shared with the other modules of the test
    process: a shared session already up with room for `DEVICES` devices is used as it is (a Ray start is
    seconds of two busy cores), any other one is shut down and a new one started and shared. `by_value`: the
    test modules whose functions and classes Ray workers get by value (they cannot import test modules)."""
    import ray
    import ray.cloudpickle

    for module in (sys.modules[__name__], *by_value):
        ray.cloudpickle.register_pickle_by_value(module)
    if ray.is_initialized():
        shared = ray.get_runtime_context().gcs_address == os.environ.get(SHARED_RAY)
        if shared and ray.cluster_resources().get("GPU", 0) >= DEVICES:
            end_module()  # hosts an earlier module's jobs parked hold bundles of their own
            return
        ray.shutdown()  # a session an earlier module left (e.g. one auto-started by a bare ray.put)
    from yatt_controller.worker_group import host_env_inherited

    with host_env_inherited():  # as a job's local Ray: hosts without a runtime_env of their own
        ray.init(
            address="local",
            num_cpus=8,
            num_gpus=DEVICES,
            include_dashboard=False,
            object_store_memory=512 * 2**20,
        )
    os.environ[SHARED_RAY] = ray.get_runtime_context().gcs_address


def end_module() -> None:
    """A module's end: the hosts its runs parked (yatt_controller.warm) go; the shared session stays."""
    from yatt_controller import warm

    warm.drop()


class ProcessWideLearner(CountingLearner):
    """A CountingLearner that leaves process-wide state `_Host.reset` cannot undo in place (it stands for
    Megatron's parallel state: a module of that name in sys.modules), so its host is never kept for a next job."""

    def __init__(self, worker_info=None):
        import types

        super().__init__(worker_info=worker_info)
        sys.modules.setdefault("megatron.core", types.ModuleType("megatron.core"))
