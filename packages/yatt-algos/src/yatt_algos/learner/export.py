"""Weights out of the learner for weight sync: named tensors in HF naming, grouped into byte-bounded buckets.

Buckets hold one dtype each (a receiver can flatten a bucket into one buffer) and at most `bucket_bytes`
bytes, except that a tensor larger than the budget travels alone. Tensors are detached views of the live
weights where possible (no copy); a receiver that keeps them past the next update must copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

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


def hf_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter of an HF model, LoRA adapters merged in.

    Under FSDP2 each shard is gathered (a collective: every rank must iterate). A peft model exports its base
    names with W + scale * B @ A computed out of place, so the live weights are not touched.
    """
    model = unwrap(model)
    peft_model = hasattr(model, "peft_config")
    modules = dict(model.named_modules()) if peft_model else {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor shard
            tensor = tensor.full_tensor()
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
