"""Sharded (DCP) learner checkpoints with two real gloo processes (shard_worker.py): FSDP2 round trip, resume
at another world size (2 -> 1 and 1 -> 2) with the same next loss, a background save staged before the next
step changes the weights, export streamed from the checkpoint, and DDP writing one copy in all."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the tiny test models are HF models")

WORKER = Path(__file__).with_name("shard_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path]:
    out, port = tmp_path_factory.mktemp("sharded"), _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    return torch.load(out / "rank0.pt", weights_only=True), out


def _sizes(out: Path, prefix: str) -> list[dict[str, int]]:
    return [torch.load(out / f"{prefix}files-{rank}.pt", weights_only=True) for rank in range(2)]


def _data_bytes(files: dict[str, int]) -> int:
    return sum(size for name, size in files.items() if name.endswith(".distcp"))


@pytest.mark.slow
def test_fsdp2_round_trip_and_reshard(run):
    result, _ = run
    assert result["round_trip_diff"] == 0.0  # the background save holds the weights before batch B
    assert result["round_trip_loss_b"] == result["loss_b"]  # model and optimizer state restored exactly
    assert result["two_to_one_loss_b"] == pytest.approx(result["loss_b"], abs=1e-6)
    assert result["one_to_two_loss_b"] == pytest.approx(result["loss_b"], abs=1e-6)


@pytest.mark.slow
def test_export_streams_the_checkpoint(run):
    result, _ = run
    assert result["export_diff"] == 0.0
    assert result["export_buckets"] == 7  # 64 KiB buckets of the tiny model: streamed, not one load


@pytest.mark.slow
def test_each_rank_writes_its_own_shards(run):
    _, out = run
    full = _data_bytes({p.name: p.stat().st_size for p in (out / "ck1").iterdir()})  # one process: all
    fsdp, ddp = _sizes(out, ""), _sizes(out, "ddp-")
    assert sorted(fsdp[0]) == [".metadata", "__0_0.distcp", "extra-0.pt"]
    assert sorted(fsdp[1]) == ["__1_0.distcp", "extra-1.pt"]
    assert all(_data_bytes(files) <= 0.6 * full for files in fsdp)
    # DDP: replicated tensors are written once in all (DCP's planner spreads them over the ranks)
    assert sum(_data_bytes(files) for files in ddp) == pytest.approx(full, rel=0.02)


def test_a_single_process_background_save_is_quiet(tiny, tmp_path):
    """DCP warns that it assumes one process on each save without a process group, from the background
    writer's thread too; that is the intent here, so no such warning reaches the user."""
    import warnings

    from yatt_algos.learner.torch_backend import TorchPolicyLearner

    learner = TorchPolicyLearner(tiny.lm(0), algo=tiny.dp_algo, optim_config=tiny.dp_optim)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        learner.save_shards(str(tmp_path), background=True)
        files = learner.wait_shards()
        learner.load_shards(str(tmp_path))
    assert sorted(files) == [".metadata", "__0_0.distcp", "extra-0.pt"]
    assert [str(w.message) for w in seen if "single process" in str(w.message)] == []
