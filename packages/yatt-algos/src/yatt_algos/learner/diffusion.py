"""The diffusion policy's learner: recomputes the log-probabilities of stored denoising transitions under the
current weights and takes clipped GRPO steps on them (`yatt_algos.flow_grpo`), beside the torch LLM learners.

It knows no diffusers: it trains `model` (the transformer, any nn.Module) through `predict(model, latents,
sigma, cond) -> velocity`, which the caller builds (yatt_rollout.diffusion_engine.velocity, with guidance).
A batch holds B images' K trained steps (`DiffusionRollout` of the engine, plus [B] advantages):

    latents, next_latents [B, K, C, h, w]; old_logprobs [B, K]; sigmas, next_sigmas [K];
    advantages [B]; cond: dict of [B, ...] tensors (prompt encodings)

Each optimizer step runs every micro-batch's steps one denoising step at a time, with its own backward (the
activations of one step of one micro-batch at a time, as Flow-GRPO), the loss scaled by the global counts
so the accumulated gradient equals one aggregate over the whole batch. Optional KL to a frozen reference
transformer: `kl_estimator` on the log-probs of the sampled transition under both (Flow-GRPO penalises the
squared distance of the two means over 2 std^2, which is the exact KL of the two Gaussians; k3 on the
sampled step is its unbiased estimate and the LLM jobs' convention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from yatt_algos.flow_grpo import flow_grpo_loss, sde_step
from yatt_algos.learner.checkpoint import check_learner_state, learner_state, set_rng_state
from yatt_algos.learner.optim import build_optimizer, build_scheduler, guarded_step
from yatt_algos.types import AlgoConfig, OptimConfig

__all__ = ["DiffusionLearner", "Predict"]

# (model, latents [b, C, h, w], sigma, cond {name: [b, ...]}) -> velocity [b, C, h, w]
Predict = Callable[[torch.nn.Module, torch.Tensor, float, dict[str, torch.Tensor]], torch.Tensor]


def _rows(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    """The micro-batch `rows` of a batch (cond sliced too; per-step schedules kept)."""
    out = {k: v[rows] for k, v in batch.items() if k not in ("cond", "sigmas", "next_sigmas")}
    out["cond"] = {k: v[rows] for k, v in batch["cond"].items()}
    return out | {"sigmas": batch["sigmas"], "next_sigmas": batch["next_sigmas"]}


class DiffusionLearner:
    """AdamW on `model` with the LLM learners' schedule, clipping and non-finite guard; `reference` a frozen
    copy for the KL term (None: no KL). `eta` and `sigma_max` must be the engine's (the transition's std).
    `before_step(params)` runs on the accumulated gradients before clipping (data parallel: averages them
    over the ranks, each of which normalised its loss by its own equal share of the batch)."""

    def __init__(
        self,
        model: torch.nn.Module,
        predict: Predict,
        *,
        algo: AlgoConfig,
        optim: OptimConfig,
        eta: float,
        sigma_max: float,
        reference: torch.nn.Module | None = None,
        before_step: Callable[[list[torch.nn.Parameter]], None] | None = None,
    ) -> None:
        if eta <= 0:
            raise ValueError(f"eta must be > 0 to train (eta 0 is the deterministic sampler), got {eta}")
        self.model, self.predict, self.reference, self.before_step = model, predict, reference, before_step
        self.algo, self.optim_cfg, self.eta, self.sigma_max = algo, optim, eta, sigma_max
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.num_steps = 0  # optimizer steps taken (the scheduler's position)
        self.num_skipped_total = 0  # steps skipped for a non-finite gradient norm

    def _step_logprob(self, model: torch.nn.Module, mb: dict[str, Any], k: int) -> torch.Tensor:
        """log p(next_latents[:, k] | latents[:, k]) [b] under `model`."""
        sigma, nxt = float(mb["sigmas"][k]), float(mb["next_sigmas"][k])
        x = mb["latents"][:, k]
        v = self.predict(model, x, sigma, mb["cond"])
        sample = mb["next_latents"][:, k]
        return sde_step(x, v, sigma, nxt, eta=self.eta, sigma_max=self.sigma_max, sample=sample)[1]

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any], *, reference: bool = False) -> torch.Tensor:
        """The stored transitions' log-probs [B, K] under the current weights (or the reference's)."""
        model = self.reference if reference else self.model
        assert model is not None, "no reference model to score with"
        out = []
        size = self.optim_cfg.micro_batch_size
        for start in range(0, len(batch["latents"]), size):
            mb = _rows(batch, slice(start, start + size))
            out.append(
                torch.stack([self._step_logprob(model, mb, k) for k in range(len(batch["sigmas"]))], 1)
            )
        return torch.cat(out)

    def update(self, batch: dict[str, Any]) -> dict[str, float]:
        """`algo.num_updates_per_batch` passes of one optimizer step over the batch (mini-batches of
        `optim.mini_batch_size` images each, 0: the whole batch). Returns the mean loss, grad norm, lr and
        the policy loss's metrics (means over steps)."""
        batch = dict(batch)
        if self.reference is not None and self.algo.kl_loss_coef:
            batch["ref_logprobs"] = self.logprobs(batch, reference=True)
        size = len(batch["latents"])
        mini = self.optim_cfg.mini_batch_size or size
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.algo.num_updates_per_batch):
            for start in range(0, size, mini):
                stats = self._optimizer_step(_rows(batch, slice(start, start + mini)))
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        return {k: v / count for k, v in sums.items()}

    def _optimizer_step(self, batch: dict[str, Any]) -> dict[str, float]:
        num_images, num_k = batch["latents"].shape[:2]
        sums: dict[str, float] = {"loss": 0.0}
        self.model.train()
        size = self.optim_cfg.micro_batch_size
        for start in range(0, num_images, size):
            mb = _rows(batch, slice(start, start + size))
            for k in range(num_k):
                logp = self._step_logprob(self.model, mb, k)[:, None]  # [b, 1]: one step of b images
                ref = mb["ref_logprobs"][:, k : k + 1] if "ref_logprobs" in mb else None
                loss, metrics = flow_grpo_loss(
                    logp,
                    mb["old_logprobs"][:, k : k + 1],
                    mb["advantages"][:, None].to(logp.dtype),
                    self.algo,
                    ref_logprobs=ref,
                    num_steps=float(num_images * num_k),
                    num_images=float(num_images),
                    max_len=self.algo.loss_agg_max_len or num_k,
                )
                # global counts make the sum over (micro-batch, step) calls the whole batch's aggregate;
                # only seq-mean-token-mean divides by each image's own step count, which one call cannot see
                scale = 1.0 / num_k if self.algo.loss_agg_mode == "seq-mean-token-mean" else 1.0
                (loss * scale).backward()
                sums["loss"] += float(loss.detach()) * scale
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value) * len(logp) / (num_images * num_k)
        params = list(self.model.parameters())
        if self.before_step is not None:
            self.before_step(params)
        norm, applied = guarded_step(
            params,
            self.optimizer,
            self.scheduler,
            max_norm=self.optim_cfg.clip_grad_norm,
        )
        self.model.eval()
        self.num_steps += int(applied)
        self.num_skipped_total += int(not applied)
        return sums | {
            "grad_norm": norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped": float(not applied),
        }

    def state(self) -> dict[str, Any]:
        """The checkpoint layout of the LLM learners (`learner.checkpoint.STATE_KEYS`), a snapshot."""
        return learner_state(self, self.model.state_dict(), self.optimizer.state_dict())

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` captured: weights, optimizer, schedule, counters and RNG streams."""
        check_learner_state(state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        self.num_steps, self.num_skipped_total = int(state["num_steps"]), int(state["num_skipped_total"])
        set_rng_state(state["rng"])
