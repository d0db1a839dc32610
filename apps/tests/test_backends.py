"""Jobs on real hardware, tested on CPU: engine and learner backend chosen in the config, hub ids, config errors
for impossible combinations, and (slow) the tiny GRPO job with vLLM's tensor-parallel rollout, the FSDP2
learner (resume parity) and the Megatron learner under the test-only CPU shim (weight sync included). The vLLM
rollout and judge with LoRA adapters, and `ray.address` joining a running cluster, run in test_two_node.py.

The slow job runs share one local Ray session (`run_job` leaves a Ray it did not start running).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from yatt_algos.types import LearnerConfig
from yatt_apps.config import (
    MEGATRON_CPU_SHIM,
    MEGATRON_NEEDS_CUDA,
    ModelSpec,
    PlacementConfig,
    RolloutSpec,
    RunConfig,
    tiny_cpu,
)
from yatt_apps.io.models import prepare_model
from yatt_placement.types import ClusterSpec

replace = msgspec.structs.replace


# ---- config errors ----------------------------------------------------------------------------------------


def _with(**fields) -> RunConfig:
    """tiny_cpu with some sections replaced (decoded through msgspec, as a YAML overlay would be)."""
    return msgspec.convert({**msgspec.to_builtins(tiny_cpu()), **fields}, RunConfig)


CONFIG_ERRORS = [
    (
        {"model": {"tensor_parallel": 2}},
        "rollout.engine='hf' cannot use model.tensor_parallel=2 (the HF engine runs on one device); set "
        "rollout.engine=vllm or model.tensor_parallel=1",
    ),
    (
        {"judge": {"tensor_parallel": 2, "seed": 1}},
        "judge.engine='hf' cannot use judge.tensor_parallel=2 (the HF engine runs on one device); set "
        "judge.engine=vllm or judge.tensor_parallel=1",
    ),
    (
        {
            "model": {"tensor_parallel": 3},
            "rollout": {"engine": "vllm"},
            "placement": {"cluster": {"num_nodes": 1, "devices_per_node": 4, "device_memory_gb": 16.0}},
        },
        "model.tensor_parallel=3 does not divide placement.cluster.devices_per_node=4 (a replica spans devices of "
        "one host)",
    ),
    (
        {"judge": {"tensor_parallel": 4, "engine": "vllm"}},
        "judge.tensor_parallel=4 does not divide placement.cluster.devices_per_node=2 (a replica spans devices of "
        "one host)",
    ),
    ({"model": {"tensor_parallel": 0}}, "model.tensor_parallel must be >= 1, got 0"),
    (
        {"model": {"arch": "qwen2_vl"}, "rollout": {"engine": "vllm"}, "judge": None, "rewards": []},
        "rollout.engine='vllm' does not serve a VLM policy (model.arch='qwen2_vl'): use 'hf'",
    ),
    (
        {"learner": {"backend": "megatron", "lora_rank": 4}, "ray": {"address": "auto"}},
        "learner.backend='megatron' has no LoRA (learner.lora_rank > 0): use 'ddp' or 'fsdp2'",
    ),
    (
        {
            "learner": {"backend": "megatron"},
            "model": {"arch": "qwen2_vl"},
            "judge": None,
            "rewards": [],
            "ray": {"address": "auto"},
        },
        "learner.backend='megatron' converts Llama/Qwen2 text models, not model.arch='qwen2_vl'",
    ),
    (
        {"learner": {"backend": "megatron", "data_parallel": "fsdp2"}},
        "LearnerConfig.backend='megatron' conflicts with data_parallel='fsdp2' (a torch-backend setting)",
    ),
    (
        {"model": {"pipeline_parallel": 2}},
        "model.pipeline_parallel=2 needs learner.backend=megatron (got 'ddp'): only the Megatron learner runs "
        "pipeline stages",
    ),
    (
        {"model": {"pipeline_parallel": 2}, "learner": {"backend": "fsdp2"}},
        "model.pipeline_parallel=2 needs learner.backend=megatron (got 'fsdp2')",
    ),
    ({"model": {"pipeline_parallel": 0}}, "model.pipeline_parallel must be >= 1, got 0"),
    (
        {"model": {"pipeline_parallel": 4}, "learner": {"backend": "megatron"}, "ray": {"address": "auto"}},
        "model.pipeline_parallel=4 does not divide the model's 2 layers",
    ),
    (
        {
            "model": {"pipeline_parallel": 2, "num_layers": 4},
            "learner": {"backend": "megatron"},
            "ray": {"address": "auto"},
            "placement": {"cluster": {"num_nodes": 2, "devices_per_node": 3, "device_memory_gb": 16.0}},
        },
        "model.tensor_parallel=1 x model.pipeline_parallel=2 = 2 does not divide "
        "placement.cluster.devices_per_node=3 (an actor replica spans devices of one host)",
    ),
    (
        {
            "model": {"tensor_parallel": 2},
            "rollout": {"engine": "vllm"},
            "learner": {"backend": "megatron"},
            "ray": {"address": "auto"},
        },
        "model.tensor_parallel=2 does not divide the model's 1 key/value heads (learner.backend=megatron splits "
        "them over tensor-parallel ranks)",
    ),
    (
        {"judge": {"pipeline_parallel": 2, "seed": 1}},
        "judge.pipeline_parallel=2: the judge is not trained; set it to 1",
    ),
]


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


def test_pipeline_parallel_reads_a_local_model_folder(tmp_path):
    """A local model's config.json gives its layers and embedding tying (a hub id is checked by the learner)."""
    config = tmp_path / "config.json"
    megatron = {"learner": {"backend": "megatron"}, "ray": {"address": "auto"}}
    config.write_text(json.dumps({"num_hidden_layers": 3, "tie_word_embeddings": False}))
    with pytest.raises(
        ValueError, match=r"^model\.pipeline_parallel=2 does not divide the model's 3 layers$"
    ):
        _with(model={"path": str(tmp_path), "pipeline_parallel": 2}, **megatron)
    config.write_text(json.dumps({"num_hidden_layers": 4, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"ties its embeddings \(tie_word_embeddings\), which the Megatron"):
        _with(model={"path": str(tmp_path), "pipeline_parallel": 2}, **megatron)
    config.write_text(
        json.dumps({"num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1})
    )
    cfg = _with(model={"path": str(tmp_path), "pipeline_parallel": 2}, **megatron)
    assert cfg.model.pipeline_parallel == 2
    with pytest.raises(
        ValueError, match=r"^model\.tensor_parallel=2 does not divide the model's 1 key/value"
    ):
        _with(model={"path": str(tmp_path), "tensor_parallel": 2}, rollout={"engine": "vllm"}, **megatron)
    assert (
        _with(model={"path": "org/not-here", "pipeline_parallel": 2}, **megatron).model.path == "org/not-here"
    )


def test_actor_replica_spans_tensor_x_pipeline_devices():
    """The planner gets an actor of tp x pp devices per replica and a rollout of tp; Megatron's rank order
    makes each replica's consecutive worker ranks one model-parallel group (stage = position // tp)."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator
    from yatt_apps.runtime.job import policy_roles
    from yatt_apps.runtime.workers import megatron_layout
    from yatt_placement.planner import plan

    cfg = _with(
        model={"pipeline_parallel": 2, "tensor_parallel": 2, "num_layers": 4, "num_kv_heads": 2},
        rollout={"engine": "vllm"},
        learner={"backend": "megatron"},
        ray={"address": "auto"},
        placement={"cluster": {"num_nodes": 1, "devices_per_node": 8, "device_memory_gb": 16.0}},
    )
    roles = {r.role: r for r in policy_roles(cfg)}
    assert roles["actor"].model_parallel_size == 4 and roles["rollout"].model_parallel_size == 2
    placed = {
        r.role: r.replicas for r in plan(cfg.placement.cluster, list(roles.values()), "colocated").roles
    }
    assert placed["actor"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(placed["rollout"]) == 4
    layout = megatron_layout(2, 4)
    assert layout == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "order": "tp-cp-ep-pp-dp",
    }
    ranks = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order=layout["order"])
    assert ranks.get_ranks("tp-pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # model-parallel group = a replica
    assert ranks.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ranks.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"model\.tensor_parallel=3 does not divide the actor replica's 4"):
        megatron_layout(3, 4)


def test_vllm_tensor_parallel_executor_on_cpu(monkeypatch):
    """On the CPU a vLLM replica's TP workers are vLLM's own processes ("mp": its Ray executor refuses the CPU
    platform), without automatic NUMA binding unless the user set one; on CUDA they are Ray workers."""
    from yatt_apps.runtime import workers

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert workers._vllm_tp_executor() == "mp" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert workers._vllm_tp_executor() == "mp" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"
    monkeypatch.setattr(workers, "device", lambda: "cuda")
    assert workers._vllm_tp_executor() == "ray"


def test_possible_combinations_pass():
    cfg = _with(
        model={"tensor_parallel": 2},
        rollout={"engine": "vllm"},
        judge={"engine": "vllm", "seed": 1},
        learner={"backend": "fsdp2"},
    )
    assert (cfg.rollout.engine, cfg.judge.engine, cfg.learner.backend) == ("vllm", "vllm", "fsdp2")


def test_backend_and_dtype_resolution():
    from yatt_apps.runtime.workers import device, dtype_name, learner_backend, sync_backend

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


def test_tensor_parallel_peers_hold_no_engine():
    """A replica over k devices: its first worker serves (vLLM's TP spans them); the k - 1 peers build nothing
    and answer with nothing (dispatch returns the first worker's answer)."""
    from yatt_apps.runtime.workers import RewardWorker, RolloutWorker
    from yatt_controller.types import WorkerInfo

    peer = WorkerInfo(role="rollout", dp_rank=0, dp_size=1, tp_rank=1, tp_size=2)
    rollout = RolloutWorker(tiny_cpu(), "/nonexistent", worker_info=peer)
    reward = RewardWorker(tiny_cpu(), "/nonexistent", worker_info=peer)
    assert (rollout.engine, reward.engine, rollout.generate(["r"]), reward.score(["r"])) == (
        None,
        None,
        [],
        {},
    )
    rollout.load_weights([("w", None)], 3)  # nothing to load into
    rollout.sleep(2), rollout.wake_up(), reward.sleep(1), reward.wake_up()


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
        sampling=replace(cfg.sampling, n=4),  # the figures below: 4 prompts x 4 samples
        controller=replace(cfg.controller, num_controllers=devices, hang_timeout_s=300.0),
        placement=PlacementConfig(
            cluster=ClusterSpec(num_nodes=1, devices_per_node=devices, device_memory_gb=16.0)
        ),
    )
    return replace(cfg, **sections)


def rules_only(cfg: RunConfig) -> RunConfig:
    """`cfg` without its judge: the rule rewards alone (a backend's job tests need no judge model on each host)."""
    return replace(cfg, judge=None, rewards=[s for s in cfg.rewards if s.kind != "genrm"])


def run(cfg: RunConfig, run_dir: Path) -> dict:
    from yatt_apps.jobs import find
    from yatt_apps.runtime.launch import run_job

    return run_job(cfg, run_dir, find(cfg.app))


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the job tests; the Megatron workers see the test-only CPU shim's switch."""
    os.environ[MEGATRON_CPU_SHIM] = "1"  # inherited by every worker process Ray starts from here
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")
    from yatt_apps.runtime.launch import ENV

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    import ray
    from yatt_apps.runtime import local_ray

    if ray.is_initialized():  # a session an earlier module left
        ray.shutdown()
    session = local_ray.start(num_cpus=16, num_gpus=4)  # the jobs' own start (tried again on a busy machine)
    yield
    session.shutdown()
    del os.environ[MEGATRON_CPU_SHIM]


@pytest.mark.slow
def test_vllm_tensor_parallel_rollout(ray_session, tmp_path):
    """`rollout.engine=vllm` with `model.tensor_parallel=2`: one rollout replica spans both devices (vLLM's
    own tensor parallelism; on CPU its mp executor), the DDP learner's two ranks feed it; rule rewards only.
    Both steps complete with the engine's logprobs of its samples within 1e-3 of the learner's."""
    base = rules_only(small(rollout=RolloutSpec(engine="vllm")))
    cfg = replace(
        base,
        model=replace(base.model, tensor_parallel=2),
        controller=replace(base.controller, num_controllers=1),
    )
    summary = run(cfg, tmp_path / "tp2")
    assert summary["step"] == 1 and summary["restarts"] == 0, summary["failures"]
    assert all(0.0 < r["train/rollout_mismatch"] < 1e-3 for r in metrics(tmp_path / "tp2").values())


@pytest.mark.slow
def test_fsdp2_learner_and_resume_parity(ray_session, tmp_path):
    """FSDP2 over two learner ranks (gloo), rule rewards only: 2 steps, checkpoints after each. A copy of that
    run directory cut back to its step-0 checkpoint, resumed, logs the same step 1 as the straight run (the
    pushes after building, after restoring and after each update stream the export bucket by bucket, both
    ranks gathering together)."""
    import shutil

    base = rules_only(small(learner=LearnerConfig(backend="fsdp2")))
    cfg = replace(base, controller=replace(base.controller, checkpoint_every=1))
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
    """Megatron-Core (TP 1, DP 2 over gloo, TEST-ONLY CPU shim), rule rewards only, 3 steps. Step 0's samples all score 0 (no
    update); step 1's update moves the weights (KL to the reference appears at step 2), and step 2's samples,
    made by the HF engines from the pushed weights, have the Megatron learner's logprobs to 1e-4."""
    cfg = rules_only(small(learner=LearnerConfig(backend="megatron")))
    cfg = replace(cfg, run=replace(cfg.run, num_steps=3, schedule_steps=3))
    summary = run(cfg, tmp_path / "megatron")
    assert summary["step"] == 2 and summary["restarts"] == 0
    rows = metrics(tmp_path / "megatron")
    assert rows[1]["train/grad_norm"] > 0 and rows[2]["train/kl"] != 0.0
    assert all(0.0 < row["train/rollout_mismatch"] < 1e-4 for row in rows.values())


@pytest.mark.slow
def test_megatron_pipeline_parallel_under_the_cpu_shim(ray_session, tmp_path):
    """Megatron-Core at PP = 2 (one actor replica over both devices, 1F1B over gloo p2p, TEST-ONLY CPU shim),
    rule rewards only, 2 steps with a checkpoint after each. Step 0's update moves the weights (KL to the reference at step 1);
    step 1's samples come from HF engines on both devices, each loaded in process from its own learner
    stage's export (so each stage must export the whole model), and match the learner's logprobs to 1e-4.
    The checkpoint's learner folder is Megatron's distributed checkpoint: each stage wrote its own slices of
    the global layout (layers stacked in one tensor per parameter, layer l at offset l): the embeddings and
    layer 0 by stage 0, layer 1 and the output layer by stage 1."""
    import torch.distributed.checkpoint as dcp

    base = rules_only(small(learner=LearnerConfig(backend="megatron")))
    cfg = replace(
        base,
        model=replace(base.model, pipeline_parallel=2),
        controller=replace(base.controller, checkpoint_every=1, num_controllers=1),  # one replica: DP = 1
    )
    summary = run(cfg, tmp_path / "pp")
    assert summary["step"] == 1 and summary["restarts"] == 0, summary["failures"]
    rows = metrics(tmp_path / "pp")
    assert all(math.isfinite(v) for row in rows.values() for v in row.values() if isinstance(v, float))
    assert rows[0]["train/grad_norm"] > 0 and rows[1]["train/kl"] > 0.0
    assert all(0.0 < row["train/rollout_mismatch"] < 1e-4 for row in rows.values())
    last = max(p for p in (tmp_path / "pp" / "checkpoints").iterdir() if p.is_dir())
    meta = dcp.FileSystemReader(last / "learner").read_metadata()
    writer = {  # (tensor, first offset) -> the rank whose file holds that chunk
        (index.fqn, index.offset[0]): int(info.relative_path.split("_")[2])
        for index, info in meta.storage_data.items()
        if index.offset is not None and not index.fqn.startswith("optimizer.")  # tensors (not extra state)
    }
    assert writer[("embedding.word_embeddings.weight", 0)] == 0 and writer[("output_layer.weight", 0)] == 1
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    assert meta.state_dict_metadata[fc1].size[0] == 2  # two layers in the global layout
    assert (writer[(fc1, 0)], writer[(fc1, 1)]) == (0, 1)


# ---- CUDA paths (gpu: skipped without CUDA; run them wherever a device is lent) ------------------------------


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not _cuda(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_hf_engine_and_torch_learner_in_bf16_on_cuda(tmp_path):
    """model.dtype auto is bf16 on CUDA: the engine and the learner sit on the device in bf16, the learner's
    logprobs of the engine's samples agree within bf16 rounding, and an update is finite with a gradient."""
    import torch
    from yatt_apps.runtime.phases import pad_batch
    from yatt_apps.runtime.workers import _torch_learners, build_engine
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    cfg = tiny_cpu()
    model_dir = str(
        prepare_model(cfg.model, tmp_path / "policy", [f"{a} + {a} = {2 * a}" for a in range(50)])
    )
    learner, _ = _torch_learners(cfg, model_dir, None, False)
    param = next(learner.model.parameters())
    assert (param.device.type, param.dtype) == ("cuda", torch.bfloat16)
    engine = build_engine(cfg, cfg.model, "hf", model_dir, seed=0)
    assert engine.device.type == "cuda" and next(engine.model.parameters()).dtype == torch.bfloat16
    prompts = [[5 + i, 7, 9 + i] for i in range(4)]
    sampling = SamplingParams(n=2, max_new_tokens=8)
    requests = [
        GenerateRequest(
            request_id=f"r-p{i}", prompt=Prompt(token_ids=ids), sampling=replace(sampling, seed=i)
        )
        for i, ids in enumerate(prompts)
    ]
    done = [c for c in engine.generate(requests) if c.token_ids]
    batch = pad_batch([prompts[int(c.request_id[-1])] for c in done], [c.token_ids for c in done], 0)
    logprobs = learner.compute_logprobs(batch).cpu()
    mask = batch["response_mask"]
    engine_lp = torch.cat([torch.tensor(c.logprobs) for c in done])
    assert float((logprobs[mask] - engine_lp).abs().mean()) < 5e-2  # bf16: about 3 significant digits
    advantages = torch.where(mask, torch.linspace(-1, 1, len(done))[:, None], 0.0)
    # the tiny config's KL loss needs reference log-probs: at step 0 the frozen reference equals the policy
    update = {**batch, "old_logprobs": logprobs, "ref_logprobs": logprobs, "advantages": advantages}
    stats = learner.update(update)
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0


def _spawn(tmp_path: Path, script: str, world: int) -> list[dict]:
    """Run `script` as ranks 0..world-1 (argv: RANK WORLD DIR), each on its own device; their JSON results."""
    path = tmp_path / "rank.py"
    path.write_text(script)
    procs = [
        subprocess.Popen([sys.executable, str(path), str(r), str(world), str(tmp_path)]) for r in range(world)
    ]
    assert [p.wait(timeout=600) for p in procs] == [0] * world
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


NCCL_SYNC = """
import json, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from yatt_controller import weight_sync

rank, world, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
torch.cuda.set_device(rank)
groups = {}
if rank == 0:
    port = weight_sync.open_store(groups, "w")[1]
    (out / "port").write_text(str(port))
while not (out / "port").exists():
    time.sleep(0.05)
weight_sync.join_group(groups, "w", "127.0.0.1", int((out / "port").read_text()), rank, world, "nccl")
g = torch.Generator().manual_seed(0)
named = [("a", torch.randn(300, 7, generator=g)), ("b", torch.randn(5, generator=g).bfloat16()),
         ("c", torch.randn(2, 2, 2, generator=g))]
named = [(n, t.cuda()) for n, t in named]
buckets = weight_sync.plan_buckets(named, 4096)
if rank == 0:
    weight_sync.send(groups["w"], named, buckets)
    diff = 0.0
else:
    got = dict(weight_sync.receive(groups["w"], buckets))
    diff = max(float((got[n].float() - t.float()).abs().max()) for n, t in named)
(out / f"rank{rank}.json").write_text(json.dumps({"diff": diff, "buckets": len(buckets)}))
"""


@pytest.mark.gpu
@gpu
def test_nccl_weight_sync_between_two_processes(tmp_path):
    """The weight-sync broadcast over NCCL between two processes on two devices: bit-exact, dtype buckets."""
    import torch

    pytest.importorskip("ray")
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between two processes needs two devices")
    results = _spawn(tmp_path, NCCL_SYNC, 2)
    assert results[1]["diff"] == 0.0 and results[1]["buckets"] == results[0]["buckets"] >= 2


MEGATRON_TP = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from megatron.core import parallel_state as ps, tensor_parallel
from transformers import Qwen2Config, Qwen2ForCausalLM
from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import AlgoConfig

rank, world, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
torch.cuda.set_device(rank)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
dist.init_process_group("nccl", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
ps.initialize_model_parallel(tensor_model_parallel_size=world, pipeline_model_parallel_size=1)
tensor_parallel.model_parallel_cuda_manual_seed(0)
torch.manual_seed(0)
config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=world * 2, tie_word_embeddings=False)
hf = Qwen2ForCausalLM(config).cuda()
g = torch.Generator().manual_seed(1)
ids = torch.randint(1, 256, (4, 24), generator=g)
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}
megatron = MegatronPolicyLearner(config, hf.state_dict(), algo=AlgoConfig(), optim_config=None)
lp_m = megatron.compute_logprobs(batch).cpu()
lp_h = TorchPolicyLearner(hf, algo=AlgoConfig(), optim_config=None).compute_logprobs(
    {k: v.cuda() for k, v in batch.items()}).cpu()
(out / f"rank{rank}.json").write_text(json.dumps({"diff": float((lp_m - lp_h).abs().max())}))
ps.destroy_model_parallel()
dist.destroy_process_group()
"""


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_megatron_logprobs_match_hf_at_tensor_parallel(tmp_path, tp):
    """Megatron-Core on CUDA over NCCL, no shim: logprobs equal the HF model's within 1e-4 (fp32, TF32 off)
    at TP = 1 and at each larger TP the machine's devices allow."""
    import torch

    pytest.importorskip("megatron.core")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} devices")
    assert all(r["diff"] < 1e-4 for r in _spawn(tmp_path, MEGATRON_TP, tp))


def test_workers_close_stops_their_engine_thread_and_keeps_the_process_rule_pool(policy_dir):
    """What a host calls before it drops a worker whose role moved away: the engine's thread (which keeps the
    engine and its memory alive) ends. The reward's rule terms run on the process's rule pool (started with
    the worker, not at the first request), which outlives the worker: the next reward worker here, or the
    next job of a host kept warm, grades on the same supervisor instead of starting an interpreter."""
    from yatt_apps.runtime.step_metrics import rule_pool, rule_workers
    from yatt_apps.runtime.workers import RewardWorker, RolloutWorker
    from yatt_multimodal.types import RewardRequest

    cfg = tiny_cpu()
    rules = msgspec.structs.replace(cfg, rewards=[r for r in cfg.rewards if r.kind != "genrm"])
    rollout = RolloutWorker(cfg, str(policy_dir))
    rule_pool().close()  # an earlier test's: the worker starts the process's pool, sized for its host
    reward = RewardWorker(rules, "")  # the rule terms only
    pool = rule_pool()
    supervisor = pool._proc
    assert reward.reward.owns == [] and pool.worker_pids()[0] == supervisor.pid  # started with the worker
    assert pool.num_workers == rule_workers(cfg)  # its host's share of the cores (1 to 4)
    request = RewardRequest(request_id="0", prompt="", response="4", reference="4")
    scores = reward.score([request])["scores"]
    assert len(pool.worker_pids()) == 1 + rule_workers(cfg)  # the supervisor and its workers, forked by now
    assert scores[0] > 0.0  # the right answer: the exact-answer term and the others
    thread = rollout.engine._worker
    assert thread.is_alive() and supervisor.poll() is None
    rollout.close(), reward.close()
    assert not thread.is_alive() and supervisor.poll() is None
    after = RewardWorker(rules, "")
    assert after.score([request])["scores"] == scores and rule_pool() is pool and pool._proc is supervisor
    after.close()
    assert (rollout.engine, reward.engine, reward.reward) == (None, None, None)
