"""Weights out of the learner for weight sync: named tensors in HF naming, grouped into byte-bounded buckets.

Buckets hold one dtype each (a receiver can flatten a bucket into one buffer) and at most `bucket_bytes`
bytes, except that a tensor larger than the budget travels alone. Tensors are detached views of the live
weights where possible (no copy); a receiver that keeps them past the next update must copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

NamedTensors = list[tuple[str, torch.Tensor]]


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group `named` in order into buckets of one dtype and at most `bucket_bytes` bytes each."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (FSDP2 shards in place, so its module is the model itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


GATHER_CHUNK_BYTES = 4 << 20  # per rank per collective: what a gather holds beside its output


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 DTensor shard (a collective), any other tensor as it is.

    A dim-0 shard over a 1-D mesh (FSDP2's layout: `torch.chunk` rows, ceil(n / world) per rank, the last
    ranks holding fewer or none) is gathered in row slices of at most GATHER_CHUNK_BYTES per rank, each
    copied into place, so the peak is the tensor once plus one slice (DTensor.full_tensor over gloo holds the
    gathered list and its concatenation: twice the tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),) or tensor.dim() == 0:
        return tensor.full_tensor()
    world, rows, group = mesh.size(), tensor.shape[0], mesh.get_group()
    per = -(-rows // world)
    # all_gather_into_tensor is deprecated (a warning per call) where torch has its successor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    local = tensor.to_local()
    if local.shape[0] != per:  # pad this rank's block to the common size
        local = torch.cat([local, local.new_zeros(per - local.shape[0], *local.shape[1:])])
    out = local.new_empty(world, per, *local.shape[1:])  # [world, per, ...]: rank r's block at out[r]
    row_bytes = max(local[:1].numel() * local.element_size(), 1)
    step = max(1, GATHER_CHUNK_BYTES // row_bytes)
    for start in range(0, per, step):
        part = local[start : start + step].contiguous()
        gathered = part.new_empty(world * part.shape[0], *part.shape[1:])  # gloo: ranks stacked on dim 0
        gather(gathered, part, group=group)
        out[:, start : start + part.shape[0]] = gathered.view(world, *part.shape)
    return out.view(world * per, *local.shape[1:])[:rows]


def export_buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[NamedTensors]:
    """`hf_named_tensors` in buckets of one dtype and at most `bucket_bytes` (a larger tensor alone), planned
    from the parameters' full shapes before anything is gathered: under FSDP2 a rank holds only the bucket it
    is filling (grouping the gathered stream, as `iter_buckets` does, would gather the next tensor while the
    full bucket waits to be yielded). Every rank must take every bucket (the gathers are collectives)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    plan: list[list[str]] = []
    size, dtype = 0, None
    for name, param in unwrap(model).named_parameters():
        if ".lora_" in name:  # merged into its base weight, which has the base's size
            continue
        nbytes = param.numel() * param.element_size()  # a DTensor's numel is the full tensor's
        if not plan or size + nbytes > bucket_bytes or param.dtype != dtype:
            plan.append([])
            size, dtype = 0, param.dtype
        plan[-1].append(name)
        size += nbytes
    for names in plan:
        yield list(hf_named_tensors(model, only=set(names)))


def hf_named_tensors(
    model: torch.nn.Module, only: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter of an HF model, LoRA adapters merged in.

    Under FSDP2 each shard is gathered (a collective: every rank must iterate). A peft model exports its base
    names with W + scale * B @ A computed out of place, so the live weights are not touched. `only`: the
    parameter names (as the model names them) to export, the others skipped without a gather.
    """
    model = unwrap(model)
    peft_model = hasattr(model, "peft_config")
    modules = dict(model.named_modules()) if peft_model else {}
    for name, param in model.named_parameters():
        if only is not None and name not in only:
            continue
        tensor = full_tensor(param.detach())
        if not peft_model:
            yield name, tensor
            continue
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):
            layer = modules[owner.removesuffix(".base_layer")]
            if leaf == "weight":
                for adapter in layer.active_adapters:
                    tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            owner = owner.removesuffix(".base_layer")
        yield f"{owner}.{leaf}".removeprefix("base_model.model."), tensor
