"""The streamed weight sync under FSDP2 (`phases.sync_weights`, `learner_weights.LearnerWeights`):

- with two real gloo ranks (stream_sync_worker.py), each pushing into its own in-process HF engine: the
  exported bytes alive anywhere at each load stay one bucket (the whole-model gather, counted the same way,
  holds the model), and the engine's weights after the sync equal the learner's full weights;
- the driver's loop, with recording doubles for the controller's context and learner group: every bucket
  gathered by every rank, pushed between two barriers at one version, the version bumped once; DDP (nothing
  gathered) and an async step (no streaming) take one push.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

WORKER = Path(__file__).with_name("stream_sync_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_sync_streams_one_bucket_at_a_time_and_the_engine_gets_the_learner_weights(tmp_path):
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    for rank in range(2):
        r = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        model = r["model_bytes"]
        assert r["buckets"] >= 5 and len(r["stream_alive"]) == r["buckets"]  # one load per bucket
        assert sum(r["bucket_bytes"]) == model  # the buckets cover the model once
        bound = (1 << 16) + r["largest_tensor_bytes"]  # a bucket (a larger tensor travels alone)
        # at every load exactly the bucket being loaded is alive: none before it was kept by anyone
        assert r["stream_alive"] == r["bucket_bytes"]
        assert max(r["stream_alive"]) <= bound < model / 2
        assert r["gather_all_alive"] == [model]  # the same count sees the whole model when it is held
        assert r["peak_bytes"] == model  # the largest held: gather_all's (streaming's was one bucket)
        assert r["names_equal"] and r["engine_diff"] == 0.0


class Ctx:
    """A controller's StepContext as the loop uses it, recording its calls in `log`."""

    def __init__(self, rank: int, sizes: list[int]) -> None:
        self.rank, self.policy_version, self.log = rank, 3, []
        push = lambda v: self.log.append(("push", v))  # noqa: E731
        self.weight_sync = SimpleNamespace(bucket_bytes=4096, push=push, pending=False)
        self.learner = SimpleNamespace(broadcast=self._broadcast)
        self._sizes = iter(sizes)

    def _broadcast(self, method: str, *args: object) -> list[int]:
        self.log.append((method, *args))
        return [next(self._sizes) if method == "next_weight_bucket" else 0] * 2  # two ranks answer alike

    def get(self, refs: list[int]) -> list[int]:
        return refs

    def barrier(self) -> None:
        self.log.append(("barrier",))

    def before_push(self) -> None:
        self.log.append(("before_push",))


def test_the_driver_streams_bucket_by_bucket_at_one_version():
    from yatt_apps.runtime.phases import sync_weights

    ctx = Ctx(0, [100, 50, 0])
    sync_weights(ctx)  # type: ignore[arg-type]
    gather, barrier = ("next_weight_bucket", 4096), ("barrier",)
    push = [barrier, ("push", 4), barrier]
    assert ctx.log == [gather, barrier, ("before_push",), ("push", 4), barrier, gather, *push, gather]
    assert ctx.policy_version == 4
    other = Ctx(1, [100, 50, 0])  # another controller: the same gathers and barriers, no push
    sync_weights(other)  # type: ignore[arg-type]
    assert other.log == [gather, barrier, barrier, gather, barrier, barrier, gather]
    assert other.policy_version == 4


def test_ddp_and_async_steps_take_one_push():
    from yatt_apps.runtime.phases import sync_weights

    once = [("barrier",), ("before_push",), ("push", 4), ("barrier",)]
    ddp = Ctx(0, [0])
    sync_weights(ddp)  # type: ignore[arg-type]
    assert ddp.log == [("next_weight_bucket", 4096), *once] and ddp.policy_version == 4
    whole = Ctx(0, [])
    sync_weights(whole, stream=False)  # type: ignore[arg-type]
    assert whole.log == [("gather_weights",), *once] and whole.policy_version == 4


def test_the_push_when_an_attempt_starts_streams_at_the_current_version():
    """A fresh or resumed attempt's engines get the learner's version as it is (no +1), bucket by bucket like
    a step's push (before, every rank gathered the whole model for it), and no sync is re-formed."""
    from yatt_apps.runtime.phases import initial_push

    ctx = Ctx(0, [100, 50, 0])
    initial_push(ctx, 3)  # type: ignore[arg-type]
    gather, barrier = ("next_weight_bucket", 4096), ("barrier",)
    assert ctx.log == [gather, barrier, ("push", 3), barrier, gather, barrier, ("push", 3), barrier, gather]
    assert ctx.policy_version == 3
