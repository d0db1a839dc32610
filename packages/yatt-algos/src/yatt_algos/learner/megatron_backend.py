"""The Megatron-Core backend: a `GPTModel` built from an HF Llama/Qwen2 config, tensor and pipeline parallel,
with the policy-learner interface of the torch backend (`compute_logprobs`, `update`, `export_weights`,
`state_dict`).

The caller owns the process groups: it initializes `megatron.core.parallel_state` (TP, PP, DP) before building
a learner, as with any Megatron-Core model. Micro-batches run through Megatron's own schedule
(`get_forward_backward_func`, 1F1B) at PP > 1, with per-token losses that are already globally normalized
(`calculate_per_token_loss`), so the schedule scales nothing; at PP = 1 a plain loop does what its
no-pipelining schedule does (that schedule allocates bookkeeping tensors on "cuda" unconditionally). Gradients are
averaged over the data-parallel group by an explicit all-reduce before the guarded step, and the gradient norm
counts tensor-parallel shards once (replicated parameters only on tensor rank 0).

Departures: the local (non-TransformerEngine) layer spec, so it runs without TransformerEngine; the causal
mask is passed explicitly; logits are gathered over the tensor-parallel group before logprobs (simple, and
[b, t, V] per micro-batch is the memory cost). Tied embeddings are supported only at PP = 1.
This backend targets GPUs; on CPU it runs only through the test-only shim in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from yatt_algos.learner import checkpoint, export, optim
from yatt_algos.learner.megatron_convert import (
    GPTArch,
    arch_from_hf,
    check_parallel,
    hf_to_megatron,
    megatron_stage_to_hf,
)
from yatt_algos.learner.packing import Batch, as_batch, micro_batches
from yatt_algos.learner.torch_backend import token_outputs
from yatt_algos.learner.update_loop import MetricSums, Normalizer, policy_objective, run_update
from yatt_algos.types import AlgoConfig, Experience, LearnerConfig, OptimConfig, TrainStats


def build_gpt_model(arch: GPTArch, *, params_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """This rank's `GPTModel` (its pipeline stage, its tensor shard) for `arch`, weights uninitialized."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    check_parallel(arch, tp, pp)
    if arch.tied_embeddings and pp > 1:
        raise ValueError("tied embeddings (config.tie_word_embeddings) are supported only at pipeline size 1")
    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # weights come from the HF checkpoint
        calculate_per_token_loss=True,  # our losses are globally normalized already
        variable_seq_lengths=True,  # micro-batches are trimmed to their own length
        moe_token_dispatcher_type="alltoall",  # no MoE here; the default one refuses variable lengths
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_positions,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag split weights with Megatron's `tensor_model_parallel` attributes, which it sets only when it
    initializes weights itself (we load them instead); the gradient norm relies on the tags."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        dim = 1 if isinstance(module, RowParallelLinear) else 0
        weight = getattr(module, "weight", None)
        split = isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding)
        if split and weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def load_hf_weights(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], arch: GPTArch) -> None:
    """Load this rank's converted shard of a full HF state dict into `model` (strict but for extra states)."""
    from megatron.core import parallel_state as ps

    shard = hf_to_megatron(
        hf_state,
        arch,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
    )
    missing, unexpected = model.load_state_dict(shard, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"HF weights do not fit the model: missing {missing}, unexpected {unexpected}")


def _causal_mask(t: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1)[
        None, None
    ]  # True = masked


class MegatronPolicyLearner:
    """Policy learner over Megatron-Core. `optim_config=None` builds an inference-only learner (reference);
    `micro_batch_size` as in `TorchPolicyLearner`."""

    def __init__(
        self,
        hf_config: Any,
        hf_state: dict[str, torch.Tensor],
        *,
        algo: AlgoConfig,
        optim_config: OptimConfig | None,
        learner: LearnerConfig | None = None,
        params_dtype: torch.dtype = torch.float32,
        micro_batch_size: int | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise ValueError(
                "initialize megatron.core.parallel_state first: the caller owns the process groups"
            )
        self.algo, self.optim_config, self.learner = algo, optim_config, learner or LearnerConfig()
        self.arch = arch_from_hf(hf_config)
        self.model = build_gpt_model(self.arch, params_dtype=params_dtype)
        mark_tensor_parallel(self.model)
        load_hf_weights(self.model, hf_state, self.arch)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.model.to(self.device)
        self.dp_group = ps.get_data_parallel_group()
        self.optimizer = self.scheduler = None
        if optim_config is not None:
            self.optimizer = optim.build_optimizer(self.model.parameters(), optim_config)
            self.scheduler = optim.build_scheduler(self.optimizer, optim_config)
        self.micro_batch_size = micro_batch_size or (optim_config.micro_batch_size if optim_config else 4)
        self.num_steps = self.num_skipped_total = 0

    def _run(self, micros: list[Batch], *, entropy: str, forward_only: bool, norm: Normalizer | None = None):
        """Megatron's schedule over `micros`; returns (per-micro outputs on the last stage, MetricSums)."""
        from megatron.core import tensor_parallel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg, outputs, sums = self.learner, [], MetricSums()
        data = iter(micros)

        def forward_step(data_iterator, model):
            mb = {k: v.to(self.device) for k, v in next(data_iterator).items()}
            b, t = mb["input_ids"].shape
            pos = torch.arange(t, device=self.device).expand(b, t)
            out = model(mb["input_ids"], pos, _causal_mask(t, self.device))

            def loss_func(logits: torch.Tensor):
                full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)  # [b, t, V]
                res = token_outputs(
                    full, mb, chunk_size=cfg.logits_chunk_size, temperature=cfg.temperature, entropy=entropy
                )
                if forward_only:
                    outputs.append(res)
                    return full.new_zeros(()), torch.tensor(1), {}
                assert norm is not None  # a training pass always has its normalizer
                loss, metrics = policy_objective(res["logprobs"], res.get("entropy"), mb, self.algo, norm)
                sums.add(loss.detach(), metrics, float(mb["response_mask"].sum()))
                return loss * norm.world_size, torch.tensor(1), {}

            return out, loss_func

        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            # what Megatron's no-pipelining schedule does, without its CUDA-only bookkeeping tensors
            for _ in micros:
                out, loss_func = forward_step(data, self.model)
                loss = loss_func(out)[0]
                if not forward_only:
                    loss.backward()
            return outputs, sums
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[self.model],
            num_microbatches=len(micros),
            seq_length=max(mb["input_ids"].shape[1] for mb in micros),
            micro_batch_size=max(mb["input_ids"].shape[0] for mb in micros),
            forward_only=forward_only,
        )
        return outputs, sums

    def _infer(self, batch: Any, entropy: str) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        batch = as_batch(batch)
        b, t = batch["input_ids"].shape
        parts = micro_batches(
            batch,
            torch.arange(b),
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.learner.max_tokens_per_micro_batch,
        )
        self.model.eval()
        with torch.no_grad():
            outs, _ = self._run([mb for _, mb in parts], entropy=entropy, forward_only=True)
        keys = ("logprobs", "entropy") if entropy != "none" else ("logprobs",)
        result = {k: torch.zeros(b, t, dtype=torch.float32, device=self.device) for k in keys}
        for (rows, mb), out in zip(parts, outs, strict=False):  # outs is empty off the last stage
            for k in keys:
                result[k][rows.to(self.device), : mb["input_ids"].shape[1]] = out[k].float()
        if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage has them: share
            for k in keys:
                dist.all_reduce(result[k], group=ps.get_pipeline_model_parallel_group())
        return {k: v.cpu() for k, v in result.items()}

    def compute_logprobs(self, batch: Experience | dict[str, Any]) -> torch.Tensor:
        """Logprobs [B, T] without grad, on every rank."""
        return self._infer(batch, "none")["logprobs"]

    def compute_logprobs_and_entropy(
        self, batch: Experience | dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, T], entropy [B, T]) without grad, 0 at position 0 and padding."""
        out = self._infer(batch, "detached")
        return out["logprobs"], out["entropy"]

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Grad norm over the whole model: TP shards once, replicated parameters on tensor rank 0, summed over
        the model-parallel group; then clip in place."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        grads = [p.grad for p in params if p.grad is not None]  # the caller passes parameters with grads
        for p in params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.float().square().sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for grad in grads:
                grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _step(self) -> tuple[float, bool]:
        # only `update` steps, after checking the optimizer; all three are built together
        assert self.optimizer is not None and self.scheduler is not None and self.optim_config is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        optim.average_gradients(params, self.dp_group)
        norm, applied = optim.guarded_step(
            params,
            self.optimizer,
            self.scheduler,
            max_norm=self.optim_config.clip_grad_norm,
            clip_fn=self._clip,
        )
        self.num_steps += applied
        self.num_skipped_total += not applied
        return norm, applied

    def update(self, experience: Experience | dict[str, Any]) -> TrainStats:
        """One PPO-style update on this data-parallel rank's shard (every TP/PP rank passes the same shard)."""
        from megatron.core import parallel_state as ps

        if self.optimizer is None:
            raise ValueError(
                "this learner has no optimizer (built with optim_config=None, e.g. a reference model)"
            )
        batch = as_batch(experience)
        for name in ("response_mask", "old_logprobs", "advantages"):
            if name not in batch:
                raise ValueError(f"update needs Experience.{name}")
        entropy = "grad" if self.algo.entropy_coef else "detached"
        # built with the optimizer (checked above)
        assert self.scheduler is not None and self.optim_config is not None
        lr = float(self.scheduler.get_last_lr()[0])
        self.model.train()
        out = run_update(
            batch,
            algo=self.algo,
            optim=self.optim_config,
            learner=self.learner,
            group=self.dp_group,
            forward_backward=lambda micros, norm: self._run(
                micros, entropy=entropy, forward_only=False, norm=norm
            )[1],
            step=self._step,
        )
        if ps.get_pipeline_model_parallel_world_size() > 1:  # metrics live on the last stage
            box = [out]
            dist.broadcast_object_list(
                box,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
            out = box[0]
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

    def _hf_named(self) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        local = {
            k: v.detach()
            for k, v in self.model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }
        stage: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for key, tensor in local.items():
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor.contiguous(), group=tp_group)
            for rank, part in enumerate(parts):
                stage[rank][key] = part
        pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        own = megatron_stage_to_hf(stage, self.arch, pp_rank=pp_rank, pp=pp)
        if pp == 1:
            yield from own.items()
            return
        for src in range(pp):  # stage by stage: HF order (embeddings, layers 0.., norm, lm_head)
            yield from self._stage_from(src, own if src == pp_rank else None)

    def _stage_from(
        self, src: int, own: dict[str, torch.Tensor] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pipeline stage `src`'s HF tensors on every stage: its (name, shape, dtype) list, then each tensor,
        broadcast over the pipeline group from `src` (`own` is its dict there, None elsewhere)."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        box = [[(k, tuple(v.shape), v.dtype) for k, v in own.items()] if own is not None else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
        names = box[0]
        assert names is not None  # the broadcast filled it on every rank
        for name, shape, dtype in names:
            tensor = (
                own[name].contiguous()
                if own is not None
                else torch.empty(shape, dtype=dtype, device=self.device)
            )
            dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
            yield name, tensor

    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[export.NamedTensors]:
        """Buckets of (HF name, full tensor) for the whole model on every rank: gathered over tensor parallel,
        then each pipeline stage's layers broadcast over the pipeline group (a collective: every TP and PP rank
        of a replica must iterate it to the end)."""
        return export.iter_buckets(self._hf_named(), bucket_bytes)

    def save_shards(self, path: str, *, background: bool = False) -> None:
        """This rank's part of a sharded checkpoint into folder `path`, every rank together, through
        Megatron's distributed checkpointing (`megatron_sharded`: loads at another TP/PP size). Synchronous:
        `background` is accepted for the learner protocol and the files are on disk when this returns."""
        from yatt_algos.learner import megatron_sharded

        self._written = megatron_sharded.save(self, path)

    def wait_shards(self) -> dict[str, tuple[str, int]]:
        """The files of the last `save_shards`: {name: (sha256, size)}."""
        written, self._written = getattr(self, "_written", {}), {}
        return written

    def load_shards(self, path: str) -> None:
        """Load a sharded checkpoint saved at any TP/PP size (every rank together)."""
        from yatt_algos.learner import megatron_sharded

        megatron_sharded.load(self, path)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: model, optimizer, scheduler, counters and RNG (each rank saves its own)."""
        model = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return checkpoint.learner_state(self, model, self.optimizer.state_dict() if self.optimizer else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint.check_learner_state(state)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"learner state does not fit the model: missing {missing}, unexpected {unexpected}"
            )
        if self.optimizer and self.scheduler:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.num_steps, self.num_skipped_total = int(state["num_steps"]), int(state["num_skipped_total"])
        checkpoint.set_rng_state(state["rng"])
