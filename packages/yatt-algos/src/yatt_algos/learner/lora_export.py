"""Adapter-only weight export of a peft LoRA learner, for weight sync: the frozen base once, the adapters after.

A LoRA learner changes only its adapter factors: for each targeted linear layer `X` (base weight W0 [out, in]),
`X.lora_A` [r, in] and `X.lora_B` [out, r], and it computes with W = W0 + scaling * B @ A. A weight sync of
such a learner need not move W for every layer: the engines hold W0 once (the first push, `base=True`) and
then get A and B alone, r * (in + out) numbers per targeted layer.

Wire names (what the rollout engines receive, `yatt_rollout.adapters`): the base tensors under their HF names
(`model.layers.0.self_attn.q_proj.weight`: peft's `base_layer` level removed, nothing merged), the adapter
tensors under peft's saved names without the `base_model.model.` prefix and without the adapter's name
(`model.layers.0.self_attn.q_proj.lora_A.weight`). B travels pre-multiplied by the layer's scaling
(lora_alpha / r), so an adapter push is complete in itself: the engine applies W0 + B' @ A with no LoRA config.

Buckets hold one kind (base or adapter) and one dtype, at most `bucket_bytes` (a larger tensor alone), planned
from the parameters' full shapes before anything is gathered: under FSDP2 every rank must take every bucket
(each tensor's gather is a collective), and a rank holds one bucket at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from yatt_algos.learner.export import NamedTensors, full_tensor, unwrap

PEFT_PREFIX = "base_model.model."
FACTORS = (".lora_A.", ".lora_B.")


def is_lora_model(model: torch.nn.Module) -> bool:
    """Whether `model` (possibly DDP-wrapped) is a peft model with adapters."""
    return hasattr(unwrap(model), "peft_config")


def wire_name(name: str) -> str:
    """The name a parameter travels under: `base_model.model.X.base_layer.weight` -> `X.weight`,
    `base_model.model.X.lora_A.default.weight` -> `X.lora_A.weight`, anything else without the peft prefix."""
    bare = name.removeprefix(PEFT_PREFIX)
    for factor in FACTORS:
        if factor in bare:
            layer, rest = bare.split(factor, 1)
            return f"{layer}{factor}{rest.rsplit('.', 1)[-1]}"  # the adapter's name dropped
    owner, _, leaf = bare.rpartition(".")
    return f"{owner.removesuffix('.base_layer')}.{leaf}"


def _plan(model: torch.nn.Module, bucket_bytes: int, base: bool) -> list[list[str]]:
    """Parameter names in buckets: every base tensor first (when `base`), then every adapter factor; a bucket
    holds one kind and one dtype."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    params = list(unwrap(model).named_parameters())
    kinds = [[n for n, _ in params if not _is_factor(n)]] if base else []
    kinds.append([n for n, _ in params if _is_factor(n)])
    shapes = dict(params)
    plan: list[list[str]] = []
    for names in kinds:
        size, dtype, fresh = 0, None, True
        for name in names:
            param = shapes[name]
            nbytes = param.numel() * param.element_size()  # a DTensor's numel is the full tensor's
            if fresh or size + nbytes > bucket_bytes or param.dtype != dtype:
                plan.append([])
                size, dtype, fresh = 0, param.dtype, False
            plan[-1].append(name)
            size += nbytes
    return plan


def _is_factor(name: str) -> bool:
    return any(factor in name for factor in FACTORS)


def _scalings(model: torch.nn.Module) -> dict[str, float]:
    """{parameter name of a lora_B factor: its layer's scaling (lora_alpha / r) for that adapter}."""
    out: dict[str, float] = {}
    for owner, module in unwrap(model).named_modules():
        scaling: Any = getattr(module, "scaling", None)
        if not isinstance(scaling, dict):
            continue
        for adapter, value in scaling.items():
            out[f"{owner}.lora_B.{adapter}.weight"] = float(value)
    return out


def lora_buckets(model: torch.nn.Module, bucket_bytes: int, *, base: bool) -> Iterator[NamedTensors]:
    """Buckets of (wire name, full tensor) of a peft LoRA model: its frozen base weights unmerged (when
    `base`), then its adapter factors, B pre-scaled. Every rank must take every bucket under FSDP2."""
    inner = unwrap(model)
    if not is_lora_model(inner):
        raise ValueError("lora_buckets: the model has no LoRA adapters (learner.lora_rank = 0)")
    params, scalings = dict(inner.named_parameters()), _scalings(inner)
    for names in _plan(inner, bucket_bytes, base):
        bucket = []
        for name in names:
            tensor = full_tensor(params[name].detach())
            if name in scalings:
                tensor = tensor * scalings[name]  # out of place: the live factor is untouched
            bucket.append((wire_name(name), tensor))
        yield bucket
