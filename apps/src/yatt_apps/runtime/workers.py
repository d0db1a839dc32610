"""The classes a job hosts on its devices (through yatt_controller's WorkerGroup): the policy learner rank with
its frozen reference, the rollout engine, and the reward service (rules and the GenRM judge).

Each is built inside its own host process from model directories, so nothing heavy crosses from the driver,
on the device Ray gave that process (CUDA when it has one, else the CPU) in the configured dtype. The config
chooses the engines (`rollout.engine`, `judge.engine`: HF or vLLM) and the learner (`learner.backend`: torch
DDP, torch FSDP2, Megatron-Core). They speak plain data: dicts of CPU tensors in, dicts of tensors or floats out.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Collection
from typing import Any

from yatt_apps.config import MEGATRON_CPU_SHIM, ModelSpec, RunConfig
from yatt_apps.io.models import load_causal_lm, load_tokenizer

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
LOOPBACK = "127.0.0.1"


def set_threads(cfg: RunConfig) -> None:
    """torch's intra-op threads for a hosted role: `placement.cpus_per_device` (at least 1). On the CPU a
    logical device is that many cores: the tiny presets put several devices on one core (1 thread each), and a
    device that owns the machine's cores lets its roles use them all (colocated roles take turns)."""
    import torch

    # torch._C's setter: an in-process vLLM CPU engine replaces `torch.set_num_threads` with a no-op once it
    # has bound its threads, which would leave this role at vLLM's count
    torch._C.set_num_threads(max(1, int(cfg.placement.cpus_per_device)))


def device() -> str:
    """This process's device: Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned, so that one is cuda:0."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_name(spec: ModelSpec) -> str:
    """The torch dtype name of `spec.dtype`; auto is bf16 on CUDA and fp32 on the CPU."""
    if spec.dtype != "auto":
        return DTYPES[spec.dtype]
    return "bfloat16" if device() == "cuda" else "float32"


def sync_backend() -> str:
    """The torch.distributed backend for learner groups and weight broadcasts: NCCL on CUDA, else gloo."""
    return "nccl" if device() == "cuda" else "gloo"


def learner_gathers_weights(cfg: RunConfig) -> bool:
    """`learner_weights.push_reads_gathered` for this job's learner: what its `LearnerWeights` decide."""
    from yatt_apps.runtime.learner_weights import push_reads_gathered

    return push_reads_gathered(learner_backend(cfg), cfg.learner.lora_rank > 0)


def learner_backend(cfg: RunConfig) -> str:
    """ddp, fsdp2 or megatron; the older `learner.data_parallel='fsdp2'` alone also means fsdp2."""
    if cfg.learner.backend == "ddp" and cfg.learner.data_parallel == "fsdp2":
        return "fsdp2"
    return cfg.learner.backend


def join_learner_group(info: Any, key: str, *, always: bool = False) -> Any:
    """The torch.distributed group of every learner worker (None for one, unless `always`): dp_size x tp_size
    ranks, rank = dp_rank x tp_size + tp_rank (a TP replica's workers are consecutive, Megatron's order).
    Rank 0 binds its store on a port the OS picks, on `store_host` (127.0.0.1 in a one-node cluster), and
    publishes `host:port` under `key` in Ray's key-value store; the other ranks wait for it. No port is chosen
    by one process and bound by another (that races). NCCL on CUDA, gloo on the CPU."""
    import torch.distributed as dist

    world, rank = info.dp_size * info.tp_size, info.dp_rank * info.tp_size + info.tp_rank
    if world == 1 and not always:
        return None
    import datetime

    import ray
    from ray.experimental import internal_kv
    from yatt_controller.weight_sync import listen_store

    timeout = datetime.timedelta(seconds=300)
    if rank == 0:
        nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]]
        host = store_host(nodes, ray.util.get_node_ip_address())
        store = listen_store(host, world, timeout)
        internal_kv._internal_kv_put(key, f"{host}:{store.port}", overwrite=True)
    else:
        store = _wait_for_store(key, world, timeout)
    dist.init_process_group(sync_backend(), store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.group.WORLD


def store_host(node_ips: Collection[str], own_ip: str) -> str:
    """Where rank 0's rendezvous store listens: 127.0.0.1 when this node is the Ray cluster's only one (every
    rank runs here; nothing off the machine needs to reach the unauthenticated store), else this node's
    address in the cluster (the one `ray start --node-ip-address` gave), never every interface."""
    return LOOPBACK if set(node_ips) <= {own_ip} else own_ip


def _wait_for_store(key: str, world: int, timeout):
    import time

    import torch.distributed as dist
    from ray.experimental import internal_kv

    deadline = time.monotonic() + timeout.total_seconds()
    while (found := internal_kv._internal_kv_get(key)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"learner rank 0 never published its rendezvous {key!r}")
        time.sleep(0.05)
    ip, port = found.decode().rsplit(":", 1)
    return dist.TCPStore(ip, int(port), world, is_master=False, timeout=timeout)


def _to_cpu(out: dict[str, Any]) -> dict[str, Any]:
    return {key: value.cpu() if hasattr(value, "cpu") else value for key, value in out.items()}


def _stats(stats: Any) -> dict[str, float]:
    """A learner's TrainStats as the step's metrics."""
    return {
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "lr": stats.lr,
        "num_skipped_steps": float(stats.num_skipped_steps),
        **stats.metrics,
    }


def _torch_learners(cfg: RunConfig, model_dir: str, group: Any, reference: bool):
    """The policy's TorchPolicyLearner (DDP or FSDP2 over `group`) on this process's device, and a frozen
    full copy for the reference when `reference`."""
    import msgspec
    from yatt_algos.learner.torch_backend import TorchPolicyLearner

    fsdp = learner_backend(cfg) == "fsdp2"
    learner = msgspec.structs.replace(cfg.learner, data_parallel="fsdp2" if fsdp else "ddp")
    trust, dtype, dev = cfg.model.trust_remote_code, dtype_name(cfg.model), device()

    def model():
        return load_causal_lm(model_dir, trust_remote_code=trust, dtype=dtype).to(dev)

    policy = TorchPolicyLearner(model(), algo=cfg.algo, optim_config=cfg.optim, learner=learner, group=group)
    if not reference:
        return policy, None
    mbs = cfg.optim.micro_batch_size  # the reference's forward runs at the size the user set, as the policy's
    return policy, TorchPolicyLearner(
        model(), algo=cfg.algo, optim_config=None, learner=learner, micro_batch_size=mbs
    )


def _megatron_learners(cfg: RunConfig, model_dir: str, info: Any, key: str, reference: bool):
    """Megatron-Core learners over every actor worker: an actor replica (its workers get the same rows) is one
    model-parallel group of `model.tensor_parallel` x `model.pipeline_parallel` ranks, data parallel = the
    replicas. CUDA only, except under the labelled test-only CPU shim ($YATT_TEST_MEGATRON_CPU_SHIM=1,
    `yatt_algos.learner.megatron_cpu_shim`)."""
    import os

    import torch

    if os.environ.get(MEGATRON_CPU_SHIM) == "1" and not torch.cuda.is_available():
        from yatt_algos.learner.megatron_cpu_shim import install

        install()  # TEST ONLY
    elif not torch.cuda.is_available():
        raise ValueError(
            "learner.backend='megatron' needs CUDA on every learner worker, and this one has none: give the "
            "actor role GPU nodes, or use learner.backend=ddp or fsdp2"
        )
    from megatron.core import parallel_state as ps
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner

    join_learner_group(info, key, always=True)
    if not ps.model_parallel_is_initialized():
        tp = cfg.model.tensor_parallel
        ps.initialize_model_parallel(**megatron_layout(tp, info.tp_size))
    if torch.cuda.is_available():  # Megatron's CUDA RNG tracker (the shim replaced it on CPU)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
    hf = load_causal_lm(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    params_dtype = getattr(torch, dtype_name(cfg.model))

    def build(optim):
        return MegatronPolicyLearner(
            hf.config,
            hf.state_dict(),
            algo=cfg.algo,
            optim_config=optim,
            learner=cfg.learner,
            params_dtype=params_dtype,
            micro_batch_size=cfg.optim.micro_batch_size,
        )

    return build(cfg.optim), build(None) if reference else None


def megatron_layout(tp: int, replica_size: int) -> dict[str, Any]:
    """`initialize_model_parallel`'s sizes and rank order for actor replicas of `replica_size` workers at
    tensor parallel `tp`. Worker rank = dp_rank x replica_size + position, so a replica's ranks are consecutive:
    order "tp-cp-ep-pp-dp" (tensor fastest, data parallel slowest) makes each replica one model-parallel group
    (position = pp_rank x tp + tp_rank); Megatron's default "tp-cp-ep-dp-pp" would put a replica's stages
    replica_size / pp ranks apart, across replicas."""
    if tp < 1 or replica_size % tp:
        raise ValueError(
            f"model.tensor_parallel={tp} does not divide the actor replica's {replica_size} devices"
        )
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": replica_size // tp,
        "order": "tp-cp-ep-pp-dp",
    }


class PolicyWorker:
    """One rank of the policy learner (`learner.backend`: torch DDP or FSDP2, or Megatron-Core), plus the frozen
    reference model when the objective has a KL term. Ranks meet in a gloo (CPU) or NCCL (GPU) group
    published under `key`.

    Weight export under FSDP2 (and Megatron TP) is a collective, and `named_weights` serves what this rank
    holds gathered to whichever rank's host the weight sync asks:
    - the step streams (`phases.sync_weights`): every rank gathers one bucket at a time (`next_weight_bucket`,
      each call freeing the bucket before), and the push of that bucket runs before the next is gathered, so
      a rank holds at most one bucket of unsharded parameters beside its shards;
    - the push when an attempt starts (fresh or after a restore: `phases.initial_push`) streams the same way;
    - an async step (generation may overlap the push) gathers the whole model (`gather_weights`) for the one
      push that follows it."""

    def __init__(self, cfg: RunConfig, model_dir: str, key: str, *, worker_info: Any) -> None:
        import torch

        set_threads(cfg)
        torch.manual_seed(cfg.run.seed)
        self.backend = learner_backend(cfg)
        reference = bool(cfg.algo.kl_loss_coef or cfg.algo.kl_reward_coef)
        if self.backend == "megatron":
            self.learner, self.reference = _megatron_learners(cfg, model_dir, worker_info, key, reference)
        else:
            group = join_learner_group(worker_info, key)
            self.learner, self.reference = _torch_learners(cfg, model_dir, group, reference)
        from yatt_apps.runtime.learner_weights import LearnerWeights

        self.weights = LearnerWeights(self.learner, self.backend)
        self.replay_own_routing = cfg.algo.routing_replay == "r2" and bool(
            getattr(self.learner, "moe", False)
        )

    def logprobs(
        self, batch: dict[str, Any], *, sum_pi_squared: bool = False, policy: bool = True
    ) -> dict[str, Any]:
        """Old (current policy) and reference logprobs [B, T] and the policy's entropy [B, T]; with
        `sum_pi_squared`, the sum of squared token probabilities [B, T] instead of the entropy (the optimal
        token baselines' input; torch learners); `policy=False`: the reference's only (bypass mode, where the
        rollout's logprobs are the old ones)."""
        self.weights.release()
        out = {}
        if sum_pi_squared:
            out["old_logprobs"], out["sum_pi_squared"] = self.learner.compute_logprobs_and_sum_pi_squared(
                batch
            )
        elif policy and self.replay_own_routing:  # R2: the expert ids of this pass are replayed in the update
            own = self.learner.compute_old_logprobs(batch)
            out |= {key: own[key] for key in ("old_logprobs", "entropy", "routed_experts")}
        elif policy:
            out["old_logprobs"], out["entropy"] = self.learner.compute_logprobs_and_entropy(batch)
        if self.reference is not None:
            out["ref_logprobs"] = self.reference.compute_logprobs(batch)
        return _to_cpu(out)

    def train(self, experience: dict[str, Any]) -> dict[str, float]:
        self.weights.release()
        return _stats(self.learner.update(experience))

    def logprobs_and_train(self, experience: dict[str, Any]) -> dict[str, Any]:
        """`logprobs` then `train` in one call, for one optimizer step per batch (torch backends): the reference
        forward, then the update whose own forward gives the old logprobs (`update_from_current`), so the
        policy's separate no-grad forward and a round trip are skipped. `experience` has no old logprobs;
        returns `logprobs`'s tensors [B, T] and, under "stats", `train`'s."""
        self.weights.release()
        out = {}
        if self.reference is not None:
            out["ref_logprobs"] = self.reference.compute_logprobs(experience)
        stats, current = self.learner.update_from_current({**experience, **out})
        return {**_to_cpu({**current, **out}), "stats": _stats(stats)}

    def gather_weights(self) -> int:
        return self.weights.gather_all()

    def next_weight_bucket(self, bucket_bytes: int) -> int:
        return self.weights.next_bucket(bucket_bytes)

    def named_weights(self) -> Any:
        return self.weights.named_weights()

    def checkpoint_state(self) -> bytes:
        import torch

        self.weights.release()
        buf = io.BytesIO()
        torch.save(self.learner.state_dict(), buf)
        return buf.getvalue()

    def load_checkpoint_state(self, data: bytes) -> None:
        import torch

        self.weights.release()
        self.learner.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))

    # The sharded checkpoint protocol (yatt_controller.controller_checkpoint prefers it to the bytes above):
    # every rank writes its own files into the checkpoint's folder, all ranks together.
    def _files(self) -> Any:
        from yatt_algos.learner.sharded import LearnerFiles

        if getattr(self, "_learner_files", None) is None:
            self._learner_files = LearnerFiles()
        return self._learner_files

    def save_checkpoint_shards(self, folder: str, background: bool) -> None:
        """Torch learners: this rank's DCP shards (FSDP2: its own shards; DDP: one copy over the ranks),
        staged in host memory and written on a thread when `background`; Megatron: its TP/PP slices through
        Megatron's distributed checkpointing (synchronous)."""
        self._files().save(self.learner, folder, background)

    def finish_checkpoint_shards(self) -> dict[str, tuple[str, int]]:
        """Wait for the last save's files: {name in the folder: (sha256, size)}."""
        return self._files().finish(self.learner)

    def load_checkpoint_shards(self, folder: str) -> None:
        """Load a folder `save_checkpoint_shards` wrote, at any torch learner world size or Megatron TP/PP
        layout (both reshard)."""
        self.weights.release()
        self._files().load(self.learner, folder)


def build_engine(
    cfg: RunConfig,
    spec: ModelSpec,
    engine: str,
    model_dir: str,
    *,
    seed: int,
    processor: Any = None,
    partial: bool = False,
    shared_device: bool = True,
    lora_rank: int = 0,
) -> Any:
    """The engine serving `spec` (`engine`: "hf" or "vllm") on this process's device in the spec's dtype. A
    vLLM engine spans the replica's `spec.tensor_parallel` devices (vLLM's own tensor parallelism);
    `shared_device` (the plan's `shares_device(role, "actor")`): the learner holds memory on the same devices;
    `lora_rank` > 0: vLLM serves the pushed LoRA adapters (the HF engine applies any)."""
    trust = spec.trust_remote_code
    if engine == "vllm":
        return _vllm_engine(
            cfg, spec, model_dir, seed=seed, partial=partial, shared=shared_device, lora=lora_rank
        )
    from yatt_rollout.hf_engine import HFEngine

    model = load_causal_lm(model_dir, trust_remote_code=trust, dtype=dtype_name(spec))
    tok = load_tokenizer(model_dir, trust_remote_code=trust)
    return HFEngine(
        model, tok, processor=processor, max_batch_size=256, seed=seed, device=device(), partial=partial
    )


def _vllm_engine(
    cfg: RunConfig, spec: ModelSpec, model_dir: str, *, seed: int, partial: bool, shared: bool, lora: int
) -> Any:
    """vLLM on the model directory: context = the model's max_position_embeddings; on CUDA native sleep, and
    a third of the device's memory where the device is shared with other roles."""
    import json
    import os
    from pathlib import Path

    from yatt_rollout.vllm_engine import VLLMEngine

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")  # compile once per machine
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    kwargs: dict[str, Any] = {"tensor_parallel_size": spec.tensor_parallel}
    if spec.tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = _vllm_tp_executor()
    if device() == "cuda":
        kwargs |= {"enable_sleep_mode": True, **({"gpu_memory_utilization": 0.3} if shared else {})}
    return VLLMEngine(
        model_dir,
        dtype=dtype_name(spec),
        seed=seed,
        trust_remote_code=spec.trust_remote_code,
        max_model_len=int(hf_config.get("max_position_embeddings", 2048)),
        partial=partial,
        lora_rank=lora,
        **kwargs,
    )


def _vllm_tp_executor() -> str:
    """vLLM's executor for a replica's TP workers. CUDA: "ray", on the replica's GPUs. CPU: "mp" (worker
    processes of this one), since vLLM's Ray executor refuses the CPU platform ("current platform cpu does not
    support ray": CpuPlatform has no Ray device key); and, unless set, VLLM_CPU_OMP_THREADS_BIND=nobind, since
    vLLM's automatic binding needs a NUMA node per TP rank (set the variable to bind cores yourself)."""
    import os

    if device() == "cuda":
        return "ray"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return "mp"


class RolloutWorker:
    """The policy's rollout engine (`rollout.engine`: HF or vLLM); receives weight pushes in process. With a
    vLLM replica over k devices (tensor parallel) the replica's first worker holds the engine and the other
    k - 1 keep its devices (they answer every call with nothing; dispatch returns the first worker's answer)."""

    def __init__(
        self, cfg: RunConfig, model_dir: str, *, shared_device: bool = True, worker_info: Any = None
    ) -> None:
        from yatt_apps.io.models import is_vlm, load_image_processor

        set_threads(cfg)
        self.engine = None
        # rollout.partial: a weight push loads while generate runs (the engine pauses its own batch)
        self.loads_while_generating = cfg.rollout.partial
        if worker_info is not None and worker_info.tp_rank > 0:
            return
        processor = load_image_processor(model_dir) if is_vlm(model_dir) else None  # image prompts
        self.engine = build_engine(
            cfg,
            cfg.model,
            cfg.rollout.engine,
            model_dir,
            seed=cfg.run.seed,
            processor=processor,
            partial=cfg.rollout.partial,
            shared_device=shared_device,
            lora_rank=cfg.learner.lora_rank,  # the policy's pushes carry its LoRA adapters
        )

    def generate(self, requests: list) -> list:
        return self.engine.generate(requests) if self.engine is not None else []

    def load_weights(self, named: list, version: int) -> None:
        """A push's tensors in this process; a LoRA learner's factors applied as an adapter (`load_push`)."""
        from yatt_rollout.adapters import load_push

        if self.engine is not None:
            load_push(self.engine, named, version)

    def sleep(self, level: int = 1) -> None:
        if self.engine is not None:
            self.engine.sleep(level)

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()

    def close(self) -> None:
        """The engine stops (its host destroys this worker when the role moves)."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None


class RewardWorker:
    """The weighted sum of `cfg.rewards`: rule terms and, when configured, a GenRM judge served by its own
    engine (`judge.engine`: HF or vLLM) in this process. `score` applies the failure policy and returns plain
    data."""

    def __init__(
        self, cfg: RunConfig, judge_dir: str = "", *, shared_device: bool = True, worker_info: Any = None
    ) -> None:
        from yatt_multimodal.reward_specs import build_combined
        from yatt_multimodal.rules import RULES

        from yatt_apps.runtime.step_metrics import rule_pool, rule_workers

        set_threads(cfg)
        self.engine = self.reward = None
        if worker_info is not None and worker_info.tp_rank > 0:
            return  # a judge over k devices (vLLM TP) lives in its replica's first worker, as in RolloutWorker
        resources: dict[str, Any] = {}
        if judge_dir:
            from yatt_multimodal.prompt_codecs import HFChatCodec

            spec = cfg.judge
            assert spec is not None, "a judge folder without judge settings"  # prepare_models makes both
            tok = load_tokenizer(judge_dir, trust_remote_code=spec.trust_remote_code)
            engine = build_engine(
                cfg, spec, spec.engine, judge_dir, seed=cfg.run.seed + 1, shared_device=shared_device
            )
            resources = {"engine": engine, "codec": HFChatCodec(tok), "seed": cfg.run.seed + 1}
        if any(spec.kind in RULES for spec in cfg.rewards):  # started now: they warm up while the roles load
            # the process's, shared with validation and later jobs
            resources["rule_pool"] = rule_pool(rule_workers(cfg))
        self.engine = resources.get("engine")
        self.reward = build_combined(cfg.rewards, **resources)

    def sleep(self, level: int = 1) -> None:
        if self.engine is not None:
            self.engine.sleep(level)

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()

    def close(self) -> None:
        """The judge's engine stops (its host destroys this worker when the role moves); the process's rule
        pool stays for the next worker or job here."""
        if self.reward is not None:
            self.reward.close()
        if self.engine is not None:
            self.engine.close()
        self.engine = self.reward = None

    def score(self, requests: list) -> dict[str, Any]:
        if self.reward is None:  # a TP peer: dispatch returns the replica's first worker's answer
            return {}
        return scored(asyncio.run(self.reward.score(requests)), self.reward.failure_policy)


def scored(batch: Any, failure_policy: Any) -> dict[str, Any]:
    """A reward worker's answer, plain data: per sample the score after the failure policy, keep, status and
    each term's score (`sample_components`: the terms that scored ok)."""
    from yatt_multimodal.rewards import resolve_failures

    resolved = resolve_failures(batch, failure_policy)
    return {
        "scores": resolved.scores,
        "keep": resolved.keep,
        "statuses": [r.status for r in batch.rewards],
        "sample_components": [dict(r.components) for r in batch.rewards],
    }
