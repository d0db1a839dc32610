"""The workers of `yatt grpo-t2i`: a learner rank of the diffusion policy (`T2ILearnerWorker`, the yatt-algos
`DiffusionLearner` over the pipeline's transformer, its data-parallel ranks averaging gradients over the
learner group) and the diffusion rollout engine (`T2IRolloutWorker`, yatt-rollout's `DiffusionEngine`), which
takes the learner's weights through the same weight sync as the LLM engines (`named_weights` /
`load_weights`: an in-process copy where they share a process, a broadcast elsewhere).

Both read the pipeline folder `t2i.path` (the job's `prepare` builds the tiny one there); the frozen VAE and
text encoder live in both (the engine encodes prompts and decodes images; the learner conditions on the
encodings the engine returns with each batch).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

__all__ = ["T2ILearnerWorker", "T2IRolloutWorker", "sampling_spec"]


def sampling_spec(cfg: Any) -> Any:
    """The engine's `DiffusionSampling` from the job's `t2i` keys."""
    from yatt_rollout.diffusion_engine import DiffusionSampling

    spec = cfg.t2i
    return DiffusionSampling(
        num_steps=spec.num_steps,
        eta=spec.eta,
        shift=spec.shift,
        guidance_scale=spec.guidance_scale,
        num_train_steps=spec.num_train_steps,
        image_size=spec.image_size,
    )


class T2ILearnerWorker:
    """One data-parallel rank of the diffusion policy's learner, with a frozen reference copy of the
    transformer when `algo.kl_loss_coef` > 0."""

    def __init__(self, cfg: Any, model_dir: str, key: str, *, worker_info: Any) -> None:
        import copy
        import functools

        import torch
        from yatt_algos.learner.diffusion import DiffusionLearner
        from yatt_algos.learner.optim import average_gradients
        from yatt_rollout.diffusion_engine import velocity
        from yatt_rollout.diffusion_models import load_t2i

        from yatt_apps.runtime.workers import join_learner_group, set_threads

        set_threads(cfg)
        torch.manual_seed(cfg.run.seed)
        group = join_learner_group(worker_info, key)
        self.policy = load_t2i(cfg.t2i.path)
        self.dp_rank = worker_info.dp_rank
        reference = copy.deepcopy(self.policy.transformer) if cfg.algo.kl_loss_coef else None
        from yatt_algos.flow_grpo import sigma_schedule

        sigmas = sigma_schedule(cfg.t2i.num_steps, cfg.t2i.shift)
        self.learner = DiffusionLearner(
            self.policy.transformer,
            functools.partial(velocity, guidance_scale=cfg.t2i.guidance_scale),
            algo=cfg.algo,
            optim=cfg.optim,
            eta=cfg.t2i.eta,
            sigma_max=float(sigmas[1]),
            reference=reference,
            before_step=None if group is None else functools.partial(average_gradients, group=group),
        )

    def update(self, batch: dict[str, Any]) -> dict[str, float]:
        """The clipped GRPO update on this rank's images (module doc of yatt_algos.learner.diffusion)."""
        import torch

        tensors = {k: torch.as_tensor(v) for k, v in batch.items() if k not in ("embeds", "pooled")}
        steps = {"sigmas": tensors.pop("sigmas")[0], "next_sigmas": tensors.pop("next_sigmas")[0]}
        cond = {"embeds": torch.as_tensor(batch["embeds"]), "pooled": torch.as_tensor(batch["pooled"])}
        return self.learner.update({**tensors, **steps, "cond": cond})

    # the weight sync's source protocol (phases.push_version): DDP-like, the live weights are read directly
    def next_weight_bucket(self, bucket_bytes: int) -> int:
        return 0

    def gather_weights(self) -> int:
        return 0

    def named_weights(self) -> list[tuple[str, Any]]:
        return [(name, p.detach()) for name, p in self.policy.transformer.named_parameters()]

    def checkpoint_state(self) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save(self.learner.state(), buf)
        return buf.getvalue()

    def load_checkpoint_state(self, data: bytes) -> None:
        import torch

        self.learner.load_state(torch.load(io.BytesIO(data), weights_only=True))

    def export(self, out_dir: str) -> str:
        """The trained pipeline as a diffusers folder (data-parallel rank 0 writes; atomic)."""
        from yatt_rollout.diffusion_models import save_t2i

        if self.dp_rank != 0:
            return ""
        return str(save_t2i(self.policy, Path(out_dir)))


class T2IRolloutWorker:
    """The diffusion engine of the policy; `generate` returns what the controller needs (numpy arrays)."""

    def __init__(
        self, cfg: Any, model_dir: str, *, shared_device: bool = False, worker_info: Any = None
    ) -> None:
        from yatt_rollout.diffusion_engine import DiffusionEngine
        from yatt_rollout.diffusion_models import load_t2i

        from yatt_apps.runtime.workers import set_threads

        set_threads(cfg)
        self.engine = DiffusionEngine(load_t2i(cfg.t2i.path), sampling_spec(cfg))

    def generate(self, prompts: list[str], seeds: list[int]) -> dict[str, Any]:
        """One image per (prompt, seed): images uint8 [B, H, W, 3], the trained steps' latents, log-probs and
        noise levels (repeated per row, [B, K]), the prompt encodings, and the policy version."""
        out = self.engine.generate(prompts, seeds)
        rows = len(prompts)
        return {
            "images": out.images,
            "latents": out.latents.numpy(),
            "next_latents": out.next_latents.numpy(),
            "old_logprobs": out.logprobs.numpy(),
            "sigmas": out.sigmas.expand(rows, -1).numpy(),
            "next_sigmas": out.next_sigmas.expand(rows, -1).numpy(),
            "embeds": out.embeds.numpy(),
            "pooled": out.pooled.numpy(),
            "policy_version": out.policy_version,
        }

    def load_weights(self, named: Any, version: int) -> None:
        self.engine.load_weights(named, version)
