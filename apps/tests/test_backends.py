"""Jobs on real hardware, tested on CPU: engine and learner backend chosen in the config, hub ids, config errors
for impossible combinations, and (slow) the tiny GRPO job with the vLLM engines, the FSDP2 learner (resume
parity), the Megatron learner under the test-only CPU shim (weight sync included) and `ray.address` joining a
Ray head the test starts.

The slow job runs share one local Ray session (`run_job` leaves a Ray it did not start running), except the
cluster test, which runs first with no session up and joins its own head.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from yatt_algos.types import LearnerConfig
from yatt_apps.config import (
    MEGATRON_CPU_SHIM,
    MEGATRON_NEEDS_CUDA,
    ModelSpec,
    RunConfig,
    tiny_cpu,
)
from yatt_apps.models import prepare_model

replace = msgspec.structs.replace


# ---- config errors ----------------------------------------------------------------------------------------


def _with(**fields) -> RunConfig:
    """tiny_cpu with some sections replaced (decoded through msgspec, as a YAML overlay would be)."""
    return msgspec.convert({**msgspec.to_builtins(tiny_cpu()), **fields}, RunConfig)


CONFIG_ERRORS = [
    ({"model": {"tensor_parallel": 2}},
     "rollout.engine='hf' cannot use model.tensor_parallel=2 (the HF engine runs on one device); set "
     "rollout.engine=vllm or model.tensor_parallel=1"),
    ({"judge": {"tensor_parallel": 2, "seed": 1}},
     "judge.engine='hf' cannot use judge.tensor_parallel=2 (the HF engine runs on one device); set "
     "judge.engine=vllm or judge.tensor_parallel=1"),
    ({"model": {"tensor_parallel": 3}, "rollout": {"engine": "vllm"},
      "placement": {"cluster": {"num_nodes": 1, "devices_per_node": 4, "device_memory_gb": 16.0}}},
     "model.tensor_parallel=3 does not divide placement.cluster.devices_per_node=4 (a replica spans devices of "
     "one host)"),
    ({"judge": {"tensor_parallel": 4, "engine": "vllm"}},
     "judge.tensor_parallel=4 does not divide placement.cluster.devices_per_node=2 (a replica spans devices of "
     "one host)"),
    ({"model": {"tensor_parallel": 0}}, "model.tensor_parallel must be >= 1, got 0"),
    ({"model": {"arch": "qwen2_vl"}, "rollout": {"engine": "vllm"}, "judge": None, "rewards": []},
     "rollout.engine='vllm' does not serve a VLM policy (model.arch='qwen2_vl'): use 'hf'"),
    ({"learner": {"backend": "megatron", "lora_rank": 4}, "ray": {"address": "auto"}},
     "learner.backend='megatron' has no LoRA (learner.lora_rank > 0): use 'ddp' or 'fsdp2'"),
    ({"learner": {"backend": "megatron"}, "model": {"arch": "qwen2_vl"}, "judge": None, "rewards": [],
      "ray": {"address": "auto"}},
     "learner.backend='megatron' converts Llama/Qwen2 text models, not model.arch='qwen2_vl'"),
    ({"learner": {"backend": "megatron", "data_parallel": "fsdp2"}},
     "LearnerConfig.backend='megatron' conflicts with data_parallel='fsdp2' (a torch-backend setting)"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), CONFIG_ERRORS)
def test_impossible_combinations_are_config_errors(fields, message):
    with pytest.raises((ValueError, msgspec.ValidationError)) as err:
        _with(**fields)
    assert message in str(err.value)


def test_megatron_without_cuda_is_a_config_error(monkeypatch):
    """No CUDA here: Megatron is refused on a local run, allowed under the test shim or when joining a cluster
    (whose learner workers check their own devices)."""
    import torch

    assert not torch.cuda.is_available()
    monkeypatch.delenv(MEGATRON_CPU_SHIM, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError) as err:
        _with(learner={"backend": "megatron"})
    assert str(err.value) == MEGATRON_NEEDS_CUDA
    assert "learner.backend='megatron' needs CUDA devices" in MEGATRON_NEEDS_CUDA
    assert _with(learner={"backend": "megatron"}, ray={"address": "auto"}).learner.backend == "megatron"
    monkeypatch.setenv(MEGATRON_CPU_SHIM, "1")
    assert _with(learner={"backend": "megatron"}).learner.backend == "megatron"


def test_possible_combinations_pass():
    cfg = _with(model={"tensor_parallel": 2}, rollout={"engine": "vllm"}, judge={"engine": "vllm", "seed": 1},
                learner={"backend": "fsdp2"})  # fmt: skip
    assert (cfg.rollout.engine, cfg.judge.engine, cfg.learner.backend) == ("vllm", "vllm", "fsdp2")


def test_backend_and_dtype_resolution():
    from yatt_apps.workers import device, dtype_name, learner_backend, sync_backend

    base = tiny_cpu()
    assert learner_backend(base) == "ddp"
    assert learner_backend(replace(base, learner=LearnerConfig(data_parallel="fsdp2"))) == "fsdp2"
    assert learner_backend(replace(base, learner=LearnerConfig(backend="fsdp2"))) == "fsdp2"
    assert (device(), sync_backend()) == ("cpu", "gloo")  # no CUDA here
    assert dtype_name(ModelSpec()) == "float32"  # auto on the CPU
    assert [dtype_name(ModelSpec(dtype=d)) for d in ("bf16", "fp16", "fp32")] == [
        "bfloat16",
        "float16",
        "float32",
    ]


# ---- hub ids ----------------------------------------------------------------------------------------------


def _hub_cache(monkeypatch, cache: Path) -> None:
    """Offline, with the HF cache at `cache` (huggingface_hub reads its cache folder from `constants`)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def test_hub_id_not_cached_offline_says_how_to_use_a_folder(monkeypatch, tmp_path):
    _hub_cache(monkeypatch, tmp_path / "hub")
    with pytest.raises(ValueError) as err:
        prepare_model(ModelSpec(path="Qwen/Qwen2.5-0.5B-Instruct"), tmp_path / "unused", [])
    assert str(err.value).startswith(
        "model.path 'Qwen/Qwen2.5-0.5B-Instruct': the hub id could not be fetched (it is not in the local "
        "Hugging Face cache and HF_HUB_OFFLINE is set). Download it where there is a network "
        "(`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`) and set model.path=DIR"
    )
    with pytest.raises(ValueError, match=r"^judge\.path 'org/judge@v2': the hub id could not be fetched"):
        prepare_model(ModelSpec(path="org/judge@v2"), tmp_path / "unused", [], key="judge.path")


def test_hub_id_resolves_to_its_cached_snapshot_offline(monkeypatch, tmp_path):
    """A snapshot already in the HF cache (the hub's cache layout, written here by hand) is used offline."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    _hub_cache(monkeypatch, cache)
    monkeypatch.chdir(tmp_path)
    assert prepare_model(ModelSpec(path="org/tiny"), tmp_path / "unused", []) == snapshot
    # a local folder of that name wins over the hub id; without config.json it is refused by name
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^model\.path 'org/tiny' is not an HF model directory"):
        prepare_model(ModelSpec(path="org/tiny"), tmp_path / "unused", [])
