"""Data parallel over gloo with two real processes: DP=2 gives the same update as DP=1 on the same global batch,
and a learner resumed from a state_dict under DP continues bit-exactly."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import LearnerConfig

pytest.importorskip("transformers", reason="the tiny test models are HF models")

WORKER = Path(__file__).with_name("dp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dp2(backend: str, out: Path) -> dict:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), backend, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    return torch.load(out / "rank0.pt", weights_only=True)


@pytest.fixture(scope="module")
def dp1(tiny):
    """DP=1 on the whole global batch, in this process."""
    learner = TorchPolicyLearner(
        tiny.lm(0),
        algo=tiny.dp_algo,
        optim_config=tiny.dp_optim,
        learner=LearnerConfig(max_tokens_per_micro_batch=40),
    )
    batch = tiny.dp_batch()
    stats = learner.update(batch)
    return {
        "weights": dict(learner.model.named_parameters()),
        "stats": stats,
        "logprobs": learner.compute_logprobs(batch),
    }


def _check(result: dict, dp1: dict) -> None:
    assert result["weights"].keys() == dp1["weights"].keys()
    diff = max(
        float((result["weights"][k] - dp1["weights"][k].detach()).abs().max()) for k in result["weights"]
    )
    assert diff < 1e-5
    assert result["loss"] == pytest.approx(dp1["stats"].loss, abs=1e-6)
    assert result["grad_norm"] == pytest.approx(dp1["stats"].grad_norm, rel=1e-5)
    assert result["num_tokens"] == dp1["stats"].num_tokens
    assert torch.allclose(result["logprobs"], dp1["logprobs"], atol=1e-5, rtol=0)
    assert result["resume_diff"] == 0.0  # state_dict -> load_state_dict under DP continues bit-exactly


def test_ddp2_equals_dp1(dp1, tiny, tmp_path):
    from yatt_algos.learner.packing import pack_micro_batches, seq_lengths

    # the two shards pack into different numbers of micro-batches (3 and 2): no per-forward collective allowed
    lengths = seq_lengths(tiny.dp_batch()["attention_mask"]).tolist()
    counts = [
        len(pack_micro_batches(lengths[r * 4 : (r + 1) * 4], micro_batch_size=2, max_tokens=40))
        for r in (0, 1)
    ]
    assert counts == [3, 2]
    result = _run_dp2("ddp", tmp_path)
    _check(result, dp1)
    assert result["state_keys"] == sorted(dp1["weights"])


@pytest.mark.slow
def test_fsdp2_equals_dp1(dp1, tmp_path):
    _check(_run_dp2("fsdp2", tmp_path), dp1)
