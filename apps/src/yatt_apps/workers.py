"""The classes a job hosts on its devices (through yatt_controller's WorkerGroup): the policy learner rank with
its frozen reference, the rollout engine, and the reward service (rules and the GenRM judge).

Each is built inside its own host process from model directories, so nothing heavy crosses from the driver.
They speak plain data: dicts of CPU tensors in, dicts of tensors or floats out.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

from yatt_apps.config import RunConfig
from yatt_apps.models import load_causal_lm, load_tokenizer


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # several hosted roles share a CPU core on the tiny preset


def join_learner_group(info: Any, key: str):
    """The torch.distributed group of a learner's data-parallel ranks (None for one rank). Rank 0 binds its
    store on a port the OS picks, on its node's IP, and publishes `ip:port` under `key` in Ray's key-value
    store; the other ranks wait for it. No port is chosen by one process and bound by another (that races)."""
    import torch
    import torch.distributed as dist

    if info.dp_size == 1:
        return None
    import datetime

    import ray
    from ray.experimental import internal_kv

    timeout = datetime.timedelta(seconds=300)
    if info.dp_rank == 0:
        ip = ray.util.get_node_ip_address()
        store = dist.TCPStore(ip, 0, info.dp_size, is_master=True, timeout=timeout, wait_for_workers=False)
        internal_kv._internal_kv_put(key, f"{ip}:{store.port}", overwrite=True)
    else:
        store = _wait_for_store(key, info.dp_size, timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=info.dp_rank, world_size=info.dp_size, timeout=timeout)
    return dist.group.WORLD


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


class PolicyWorker:
    """One data-parallel rank of the policy learner (torch backend), plus the frozen reference model when
    the objective has a KL term. Ranks meet in a gloo (CPU) or NCCL (GPU) group published under `key`."""

    def __init__(self, cfg: RunConfig, model_dir: str, key: str, *, worker_info: Any) -> None:
        import torch
        from yatt_algos.learner.torch_backend import TorchPolicyLearner

        _one_thread()
        torch.manual_seed(cfg.run.seed)
        group = join_learner_group(worker_info, key)
        trust = cfg.model.trust_remote_code
        self.learner = TorchPolicyLearner(
            load_causal_lm(model_dir, trust_remote_code=trust), algo=cfg.algo, optim_config=cfg.optim,
            learner=cfg.learner, group=group,
        )  # fmt: skip
        self.reference = None
        if cfg.algo.kl_loss_coef or cfg.algo.kl_reward_coef:
            self.reference = TorchPolicyLearner(
                load_causal_lm(model_dir, trust_remote_code=trust), algo=cfg.algo, optim_config=None,
                learner=cfg.learner,
            )  # fmt: skip

    def logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Old (current policy) and reference logprobs [B, T] and the policy's entropy [B, T]."""
        old, entropy = self.learner.compute_logprobs_and_entropy(batch)
        out = {"old_logprobs": old, "entropy": entropy}
        if self.reference is not None:
            out["ref_logprobs"] = self.reference.compute_logprobs(batch)
        return out

    def train(self, experience: dict[str, Any]) -> dict[str, float]:
        stats = self.learner.update(experience)
        return {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                "num_skipped_steps": float(stats.num_skipped_steps), **stats.metrics}  # fmt: skip

    def named_weights(self):
        for bucket in self.learner.export_weights(64 << 20):
            yield from bucket

    def checkpoint_state(self) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save(self.learner.state_dict(), buf)
        return buf.getvalue()

    def load_checkpoint_state(self, data: bytes) -> None:
        import torch

        self.learner.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))


class RolloutWorker:
    """A yatt-rollout HF engine over the policy's weights; receives weight pushes in process."""

    def __init__(self, cfg: RunConfig, model_dir: str) -> None:
        from yatt_rollout.hf_engine import HFEngine

        from yatt_apps.models import is_vlm, load_image_processor

        _one_thread()
        trust = cfg.model.trust_remote_code
        processor = load_image_processor(model_dir) if is_vlm(model_dir) else None  # image prompts
        self.engine = HFEngine(
            load_causal_lm(model_dir, trust_remote_code=trust), load_tokenizer(model_dir, trust_remote_code=trust),
            processor=processor, max_batch_size=256, seed=cfg.run.seed,
        )  # fmt: skip

    def generate(self, requests: list) -> list:
        return self.engine.generate(requests)

    def load_weights(self, named: list, version: int) -> None:
        self.engine.load_weights(named, version)

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()


class RewardWorker:
    """The weighted sum of `cfg.rewards`: rule terms and, when configured, a GenRM judge served by its own
    yatt-rollout engine in this process. `score` applies the failure policy and returns plain data."""

    def __init__(self, cfg: RunConfig, judge_dir: str = "") -> None:
        from yatt_multimodal.reward_specs import build_combined

        _one_thread()
        resources: dict[str, Any] = {}
        if judge_dir:
            from yatt_multimodal.prompt_codecs import HFChatCodec
            from yatt_rollout.hf_engine import HFEngine

            trust = cfg.judge.trust_remote_code
            tok = load_tokenizer(judge_dir, trust_remote_code=trust)
            model = load_causal_lm(judge_dir, trust_remote_code=trust)
            engine = HFEngine(model, tok, max_batch_size=256, seed=cfg.run.seed + 1)
            resources = {"engine": engine, "codec": HFChatCodec(tok), "seed": cfg.run.seed + 1}
        self.engine = resources.get("engine")
        self.reward = build_combined(cfg.rewards, **resources)

    def sleep(self, level: int = 1) -> None:
        if self.engine is not None:
            self.engine.sleep(level)

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()

    def score(self, requests: list) -> dict[str, Any]:
        from yatt_multimodal.rewards import resolve_failures

        batch = asyncio.run(self.reward.score(requests))
        resolved = resolve_failures(batch, self.reward.failure_policy)
        return {"scores": resolved.scores, "keep": resolved.keep, "statuses": [r.status for r in batch.rewards],
                "sample_components": [dict(r.components) for r in batch.rewards]}  # fmt: skip
