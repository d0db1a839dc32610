"""One PPO-style update, shared by both backends: epochs, mini-batches, global normalizers, the guarded step.

A backend supplies `forward_backward(micro_batches, norm) -> MetricSums` (forward, loss, backward with
gradient accumulation) and `step() -> (grad_norm, applied)`. The normalizer of each mini-batch is global:
response tokens and non-empty sequences summed over all micro-batches and data-parallel ranks, and the
padded length maxed over ranks, so that with `aggregation.aggregate(..., num_tokens=, num_seqs=, max_len=)`
the sum of the micro-batch losses is the whole mini-batch's loss. Data parallel backends average gradients
over ranks, so each micro-batch loss is multiplied by the world size before backward.

`policy_objective` and `critic_objective` are the per-micro-batch losses; both are pure functions of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from yatt_algos.aggregation import aggregate
from yatt_algos.kl import kl_penalty
from yatt_algos.learner.packing import Batch, micro_batches, split_mini_batches
from yatt_algos.policy_losses import POLICY_LOSSES
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig
from yatt_algos.value import value_loss


class Normalizer(NamedTuple):
    """Global counts of one mini-batch (over micro-batches and data-parallel ranks)."""

    num_tokens: float
    num_seqs: float
    max_len: int
    world_size: int


class MetricSums:
    """Per-rank sums of micro-batch metrics, reduced over ranks at the end of an update.

    Keys ending in `_max` / `_min` reduce by max / min; `loss` is summed (each micro-batch's share of the
    global loss); every other metric is a token-weighted mean.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], num_tokens: float) -> None:
        """Adds one micro-batch's scalar loss and metrics, weighted by its token count."""
        self.sums["loss"] = self.sums.get("loss", 0.0) + float(loss)
        self.tokens += num_tokens
        for key, value in metrics.items():
            v = float(value)
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, -float("inf")), v)
            elif key.endswith("_min"):
                self.sums[key] = min(self.sums.get(key, float("inf")), v)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + v * num_tokens

    def merge(self, other: MetricSums) -> None:
        """Adds another accumulator's sums into this one."""
        for key, value in other.sums.items():
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, -float("inf")), value)
            elif key.endswith("_min"):
                self.sums[key] = min(self.sums.get(key, float("inf")), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value
        self.tokens += other.tokens

    def reduce(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Means, maxima and minima over every rank (a collective when a group is given)."""
        keys = sorted(self.sums)
        total = torch.tensor(
            [self.tokens] + [self.sums[k] for k in keys if not _extreme(k)], dtype=torch.float64
        )
        ext = torch.tensor(
            [self.sums[k] if k.endswith("_max") else -self.sums[k] for k in keys if _extreme(k)]
        )
        if _world(group) > 1:
            dist.all_reduce(total, group=group)
            if len(ext):
                dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
        tokens, rest = max(float(total[0]), 1.0), iter(total[1:].tolist())
        out, ext_values = {}, iter(ext.tolist())
        for k in keys:
            if _extreme(k):
                v = next(ext_values)
                out[k] = v if k.endswith("_max") else -v
            else:
                v = next(rest)
                out[k] = v if k == "loss" else v / tokens
        return out


def _extreme(key: str) -> bool:
    return key.endswith(("_max", "_min"))


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def plan_normalizers(
    batch: Batch, minis: list[torch.Tensor], algo: AlgoConfig, group: dist.ProcessGroup | None
) -> list[Normalizer]:
    """Global Normalizer of each mini-batch; checks that every rank has as many mini-batches."""
    mask = batch["response_mask"]
    local = [[float(mask[r].sum()), float((mask[r].sum(-1) > 0).sum())] for r in minis]
    counts = torch.tensor(local, dtype=torch.float64)  # [M, 2]
    shape = torch.tensor([len(minis), -len(minis), mask.shape[1]], dtype=torch.float64)
    world = _world(group)
    if world > 1:
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
        if shape[0] != -shape[1]:
            raise ValueError(
                f"ranks have different numbers of mini-batches ({int(-shape[1])}..{int(shape[0])}): "
                "give every rank the same batch size"
            )
        dist.all_reduce(counts, group=group)
    max_len = algo.loss_agg_max_len or int(shape[2])
    return [Normalizer(float(t), float(s), max_len, world) for t, s in counts.tolist()]


def run_update(
    batch: Batch,
    *,
    algo: AlgoConfig,
    optim: OptimConfig,
    learner: LearnerConfig,
    group: dist.ProcessGroup | None,
    forward_backward: Callable[[list[Batch], Normalizer], MetricSums],
    step: Callable[[], tuple[float, bool]],
) -> dict[str, float]:
    """Epochs x mini-batches of forward_backward + step. Returns reduced metrics plus `grad_norm` (mean over
    applied steps), `num_steps`, `num_skipped_steps` and `num_tokens` (global response tokens, one pass)."""
    minis = split_mini_batches(batch["input_ids"].shape[0], optim.mini_batch_size)
    norms = plan_normalizers(batch, minis, algo, group)
    sums, grad_norms, skipped = MetricSums(), [], 0
    for _ in range(algo.num_updates_per_batch):
        for rows, norm in zip(minis, norms, strict=True):
            micros = micro_batches(
                batch,
                rows,
                micro_batch_size=optim.micro_batch_size,
                max_tokens=learner.max_tokens_per_micro_batch,
            )
            sums.merge(forward_backward([mb for _, mb in micros], norm))
            grad_norm, applied = step()
            if applied:
                grad_norms.append(grad_norm)
            else:
                skipped += 1
    out = sums.reduce(group)
    num_steps = algo.num_updates_per_batch * len(minis)
    out["loss"] = out.get("loss", 0.0) / num_steps  # each step's global loss, averaged over steps
    out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    out["num_steps"] = num_steps
    out["num_skipped_steps"] = skipped
    out["num_tokens"] = sum(n.num_tokens for n in norms)
    return out


def _agg(values: torch.Tensor, mask: torch.Tensor, algo: AlgoConfig, norm: Normalizer) -> torch.Tensor:
    return aggregate(
        values,
        mask,
        algo.loss_agg_mode,
        num_tokens=norm.num_tokens,
        num_seqs=norm.num_seqs,
        max_len=norm.max_len,
    )


def policy_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: Batch,
    algo: AlgoConfig,
    norm: Normalizer,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the mini-batch loss: policy loss (+ kl_loss_coef * KL to the reference)
    (- entropy_coef * entropy), each aggregated by `algo.loss_agg_mode` under `norm`. logprobs, entropy [b, t]."""
    if algo.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"AlgoConfig.policy_loss {algo.policy_loss!r} is not one of {sorted(POLICY_LOSSES)}")
    mask = mb["response_mask"]
    per_token, metrics = POLICY_LOSSES[algo.policy_loss](
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        mask,
        algo,
        rollout_logprobs=mb.get("rollout_logprobs"),
    )
    loss = _agg(per_token, mask, algo, norm)
    metrics = {**metrics, "pg_loss": loss.detach() * _share(mask, norm)}
    if algo.kl_loss_coef:
        if "ref_logprobs" not in mb:
            raise ValueError("AlgoConfig.kl_loss_coef > 0 needs Experience.ref_logprobs")
        kl = _agg(kl_penalty(logprobs, mb["ref_logprobs"], algo.kl_estimator), mask, algo, norm)
        loss = loss + algo.kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach() * _share(mask, norm)
    if entropy is not None:
        ent = _agg(entropy, mask, algo, norm)
        loss = loss - algo.entropy_coef * ent
        metrics["entropy"] = ent.detach() * _share(mask, norm)
    return loss, metrics


def critic_objective(
    values: torch.Tensor, mb: Batch, algo: AlgoConfig, learner: LearnerConfig, norm: Normalizer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the clipped value loss (PPO), aggregated like the policy loss. values [b, t]."""
    for name in ("returns", "old_values"):
        if name not in mb:
            raise ValueError(f"the critic update needs Experience.{name}")
    mask = mb["response_mask"]
    per_token, metrics = value_loss(
        values, mb["old_values"], mb["returns"], mask, clip_range=learner.value_clip_range
    )
    loss = _agg(per_token, mask, algo, norm)
    return loss, {**metrics, "vf_loss": loss.detach() * _share(mask, norm)}


def _share(mask: torch.Tensor, norm: Normalizer) -> float:
    """Converts an aggregated micro-batch scalar into a per-token mean that MetricSums re-weights by tokens:
    metric * tokens summed over micro-batches and ranks, / global tokens = the global aggregate."""
    local = float(mask.sum())
    return norm.num_tokens / local if local else 0.0
