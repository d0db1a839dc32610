"""The torch training engine under both torch learners: model preparation (LoRA, gradient checkpointing),
data parallel wrapping (DDP or FSDP2 over the given process group), micro-batch forward/backward with
gradient accumulation, the guarded optimizer step, no-grad inference, checkpoint state and weight export.

The policy and critic learners in `torch_backend` differ only in their forward (logprobs or values) and their
objective; everything here is shared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from yatt_algos.learner import checkpoint, export, lora_export, optim
from yatt_algos.learner.packing import Batch, as_batch, micro_batches
from yatt_algos.learner.sharded import FileEntries, PendingSave, ShardedState
from yatt_algos.learner.update_loop import MetricSums, Normalizer, run_update
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig, TrainStats

# (model, micro-batch, grad enabled) -> per-token outputs of the micro-batch, e.g. {"logprobs": [b, t]}
ForwardFn = Callable[[torch.nn.Module, Batch, bool], dict[str, torch.Tensor]]
# (forward outputs, micro-batch, normalizer) -> (loss share, metrics)
ObjectiveFn = Callable[[dict[str, torch.Tensor], Batch, Normalizer], tuple[torch.Tensor, dict]]


def apply_lora(model: torch.nn.Module, cfg: LearnerConfig) -> torch.nn.Module:
    """Wrap `model` in peft LoRA adapters when cfg.lora_rank > 0 (base weights frozen)."""
    if cfg.lora_rank == 0:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,  # peft annotates int; a float works too (it scales by alpha / r)
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
    )
    return get_peft_model(model, lora)


def wrap_data_parallel(
    model: torch.nn.Module, cfg: LearnerConfig, group: dist.ProcessGroup | None
) -> torch.nn.Module:
    """DDP or FSDP2 over `group`; the model itself when there is no group."""
    if group is None:
        return model
    if cfg.data_parallel == "ddp":
        # no buffer broadcast: HF buffers are constants (RoPE), and a per-forward collective would tie ranks
        # to equal micro-batch counts, which token-budget packing does not give
        return torch.nn.parallel.DistributedDataParallel(model, process_group=group, broadcast_buffers=False)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type=device)
    layer_types = set(getattr(model, "_no_split_modules", None) or ())  # HF: the decoder layer class
    for module in list(model.modules()):
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh)
    sharded = fully_shard(model, mesh=mesh)  # the same object, its class extended with FSDPModule
    assert isinstance(sharded, torch.nn.Module)
    return sharded


class TorchEngine:
    """Owns the (wrapped) model, optimizer, scheduler and counters of one learner rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algo: AlgoConfig,
        optim_config: OptimConfig | None,
        learner: LearnerConfig,
        group: dist.ProcessGroup | None,
    ) -> None:
        if group is not None and not dist.is_initialized():
            raise ValueError("a process group was given but torch.distributed is not initialized")
        self.algo, self.optim_config, self.learner, self.group = algo, optim_config, learner, group
        model = apply_lora(model, learner)
        if learner.gradient_checkpointing:
            hf: Any = model  # an HF PreTrainedModel: nn.Module's typing does not see its methods
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = wrap_data_parallel(model, learner, group)
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.device = next(model.parameters()).device
        self.optimizer = self.scheduler = None
        if optim_config is not None:
            self.optimizer = optim.build_optimizer(self.model.parameters(), optim_config)
            self.scheduler = optim.build_scheduler(self.optimizer, optim_config)
        self.num_steps = 0  # optimizer steps applied
        self.num_skipped_total = 0
        self.shards = ShardedState(self)  # sharded (DCP) checkpoints: save_shards / load_shards

    @property
    def fsdp(self) -> bool:
        return self.group is not None and self.learner.data_parallel == "fsdp2"

    def _equalize(self, micros: list[Batch]) -> list[Batch]:
        """FSDP2 runs collectives in every forward: pad with empty-mask copies to the ranks' max count."""
        if not self.fsdp:
            return micros
        count = torch.tensor([len(micros)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        filler = {k: v[:1] for k, v in micros[0].items()}
        filler = filler | {k: torch.zeros_like(filler[k]) for k in ("response_mask",) if k in filler}
        return micros + [filler] * (int(count) - len(micros))

    def _sync_context(self, last: bool):
        """Gradient all-reduce only on the last micro-batch of a mini-batch."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) and not last:
            return self.model.no_sync()
        if self.fsdp:
            fsdp: Any = (
                self.model
            )  # an FSDPModule (see wrap_data_parallel); nn.Module typing hides its methods
            fsdp.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def forward_backward(
        self, micros: list[Batch], norm: Normalizer, forward: ForwardFn, objective: ObjectiveFn
    ) -> MetricSums:
        """Accumulate gradients over `micros`; returns this rank's metric sums."""
        self.model.train()
        sums = MetricSums()
        micros = self._equalize(micros)
        for i, mb in enumerate(micros):
            mb = {k: v.to(self.device) for k, v in mb.items()}
            with self._sync_context(last=i == len(micros) - 1):
                loss, metrics = objective(forward(self.model, mb, True), mb, norm)
                (loss * norm.world_size).backward()  # DP averages gradients over ranks; the loss is a share
            sums.add(loss.detach(), metrics, float(mb["response_mask"].sum()))
        return sums

    def step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients unless non-finite: (grad norm, applied)."""
        assert self.optimizer is not None and self.scheduler is not None and self.optim_config is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm, applied = optim.guarded_step(
            params, self.optimizer, self.scheduler, max_norm=self.optim_config.clip_grad_norm
        )
        self.num_steps += applied
        self.num_skipped_total += not applied
        return norm, applied

    def update(
        self, batch: Any, forward: ForwardFn, objective: ObjectiveFn, required: tuple[str, ...]
    ) -> TrainStats:
        """One update over `batch` ([B, T] fields, `required` among them) with a forward and objective."""
        if self.optimizer is None:
            raise ValueError(
                "this learner has no optimizer (built with optim_config=None, e.g. a reference model)"
            )
        batch = as_batch(batch)
        for name in required:
            if name not in batch:
                raise ValueError(f"update needs Experience.{name}")
        # built with the optimizer (checked above)
        assert self.scheduler is not None and self.optim_config is not None
        lr = float(self.scheduler.get_last_lr()[0])
        out = run_update(
            batch,
            algo=self.algo,
            optim=self.optim_config,
            learner=self.learner,
            group=self.group,
            forward_backward=lambda micros, norm: self.forward_backward(micros, norm, forward, objective),
            step=self.step,
        )
        skipped = int(out.pop("num_skipped_steps"))
        loss, grad_norm, num_tokens = (
            float(out.pop("loss")),
            float(out.pop("grad_norm")),
            int(out.pop("num_tokens")),
        )
        out.pop("num_steps")
        out["skipped_steps_total"] = float(self.num_skipped_total)
        return TrainStats(
            step=self.num_steps,
            lr=lr,
            num_skipped_steps=skipped,
            metrics=out,
            loss=loss,
            grad_norm=grad_norm,
            num_tokens=num_tokens,
        )

    @torch.no_grad()
    def infer(self, batch: Any, forward: ForwardFn, micro_batch_size: int) -> dict[str, torch.Tensor]:
        """Per-token outputs [B, T] for the whole batch (0 at padding), on the CPU, in micro-batches, without
        grad. Micro-batches move to the model's device."""
        batch = as_batch(batch)
        self.model.eval()
        b, t = batch["input_ids"].shape
        rows = torch.arange(b)
        parts = micro_batches(
            batch, rows, micro_batch_size=micro_batch_size, max_tokens=self.learner.max_tokens_per_micro_batch
        )
        outputs: dict[str, torch.Tensor] = {}
        micros = self._equalize([mb for _, mb in parts])
        model = self.model if self.fsdp else export.unwrap(self.model)  # DDP's forward is not needed here
        for i, mb in enumerate(micros):
            result = forward(model, {k: v.to(self.device) for k, v in mb.items()}, False)
            if i >= len(parts):
                continue  # an FSDP2 filler
            idx, width = parts[i][0], mb["input_ids"].shape[1]
            for key, value in result.items():
                outputs.setdefault(key, value.new_zeros(b, t, dtype=torch.float32))[idx, :width] = (
                    value.float()
                )
        return outputs

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (cloned tensors) of model, optimizer, scheduler, counters and RNG.

        Under FSDP2 a collective, and every rank gets the full (unsharded) model and optimizer state, so any
        rank's file restores the model; each rank saves its own for its RNG. What scales is `save_shards`."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            opts = StateDictOptions(
                full_state_dict=True
            )  # on every rank (cpu_offload would keep rank 0 only)
            model_state, optim_state = get_state_dict(
                self.model, [self.optimizer] if self.optimizer else [], options=opts
            )
        else:
            model_state = export.unwrap(self.model).state_dict()
            optim_state = self.optimizer.state_dict() if self.optimizer else {}
        return checkpoint.learner_state(self, model_state, optim_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint.check_learner_state(state)
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
            optims = [self.optimizer] if self.optimizer else []
            set_state_dict(
                self.model,
                optims,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=opts,
            )
        else:
            export.unwrap(self.model).load_state_dict(state["model"])
            if self.optimizer:
                self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler:
            self.scheduler.load_state_dict(state["scheduler"])
        self.num_steps, self.num_skipped_total = int(state["num_steps"]), int(state["num_skipped_total"])
        checkpoint.set_rng_state(state["rng"])

    def save_shards(self, path: str, *, background: bool = False) -> PendingSave:
        """This rank's part of a sharded (DCP) checkpoint into folder `path`, every rank together
        (`sharded.ShardedState.save`); `background`: staged to host memory, written by a thread."""
        return self.shards.save(path, background=background)

    def wait_shards(self) -> FileEntries:
        """The files of the last `save_shards` once written: {name: (sha256, size)}."""
        return self.shards.wait()

    def load_shards(self, path: str) -> None:
        """Load a sharded checkpoint saved at any world size (every rank together)."""
        self.shards.load(path)

    def export_weights(self, bucket_bytes: int) -> Iterator[export.NamedTensors]:
        """Buckets of (HF name, tensor) of at most `bucket_bytes` each; under FSDP2 each bucket's shards are
        gathered when it is taken (every rank takes every bucket), so a rank holds one bucket at a time."""
        return export.export_buckets(self.model, bucket_bytes)

    @property
    def lora(self) -> bool:
        """Whether this engine trains LoRA adapters (peft) instead of all weights."""
        return lora_export.is_lora_model(self.model)

    def export_lora(self, bucket_bytes: int, *, base: bool) -> Iterator[export.NamedTensors]:
        """Adapter-only weight sync of a LoRA engine (`lora_export.lora_buckets`): the frozen base weights
        unmerged (when `base`), then the adapter factors (B pre-scaled), in buckets of one kind and dtype;
        under FSDP2 every rank takes every bucket."""
        return lora_export.lora_buckets(self.model, bucket_bytes, base=base)
