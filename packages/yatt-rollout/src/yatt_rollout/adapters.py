"""LoRA adapter-only weight sync into an HF engine: only the adapter tensors cross, the engine applies them.

A LoRA learner (peft) trains, for each targeted linear layer `X` with frozen weight W0 [out, in], the pair
`X.lora_A.weight` [r, in] and `X.lora_B.weight` [out, r]; the model it trains computes with
W = W0 + scaling * B @ A (scaling = lora_alpha / r). Sending W for every layer at every sync moves the whole
model; sending A and B moves r * (in + out) numbers per layer instead. `AdapterMerger` keeps W0 of the targeted
layers the first time an adapter reaches them and sets W = W0 + scaling * B @ A on each sync, so the engine's
forward is that of the merged model and generation runs at dense speed. A full weight load of a layer makes
the loaded weight its new W0.

Names are peft's (`get_peft_model_state_dict`), with or without its `base_model.model.` prefix:
`model.layers.0.self_attn.q_proj.lora_A.weight`. A tensor that names no linear weight of the model is a
ValueError naming it.

A job's weight push may carry both kinds (a LoRA learner's first push: the base weights, then the factors):
`load_push` loads the full tensors into any engine and applies the factors through its `load_adapter` (the HF
engine here, vLLM's LoRA request API in `vllm_lora`). The learner sends B pre-multiplied by its scaling, so a
pushed adapter is applied with scaling 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."


def adapter_pairs(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{weight name of the targeted layer: (A [r, in], B [out, r])} from peft-named tensors. ValueError
    naming a tensor that is not a LoRA factor, or a layer given only one of its two."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        bare = name.removeprefix(PEFT_PREFIX)
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}."
            if marker in bare:
                layer = bare.split(marker)[0]
                factors.setdefault(f"{layer}.weight", {})[kind] = tensor
                break
        else:
            raise ValueError(f"adapter tensor {name!r} is not a LoRA factor (lora_A / lora_B)")
    pairs = {}
    for weight, got in factors.items():
        if set(got) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"adapter for {weight!r} has only {sorted(got)}: both lora_A and lora_B are needed"
            )
        pairs[weight] = (got["lora_A"], got["lora_B"])
    return pairs


def is_factor(name: str) -> bool:
    """Whether `name` is a LoRA factor's (`... .lora_A. ...` / `... .lora_B. ...`)."""
    return ".lora_A." in name or ".lora_B." in name


def split_push(
    named: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(full tensors, LoRA factors) of a weight push, each in the push's order."""
    full = [(n, t) for n, t in named if not is_factor(n)]
    return full, [(n, t) for n, t in named if is_factor(n)]


def load_push(engine: Any, named: Sequence[tuple[str, torch.Tensor]], version: int) -> int:
    """A weight push (named tensors in this process) into `engine` as `version`: full tensors loaded
    (`load_weights`, or `update_weights` buckets for vLLM), then LoRA factors (B pre-scaled) applied through
    `engine.load_adapter`. Returns the bytes the engine received."""
    full, factors = split_push(named)
    if full or not factors:
        if hasattr(engine, "load_weights"):
            engine.load_weights(full, version)
        else:
            from yatt_rollout.buckets import make_buckets

            engine.update_weights(make_buckets(full, max_bytes=256 << 20), version)
    if factors:
        if not hasattr(engine, "load_adapter"):
            raise ValueError(f"{type(engine).__name__} cannot apply LoRA adapters (a LoRA learner's push)")
        engine.load_adapter(factors, scaling=1.0, version=version)
    return nbytes(named)


def nbytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Bytes of the tensors (what a sync of them moves)."""
    return sum(t.numel() * t.element_size() for _, t in named)


class AdapterMerger:
    """Applies LoRA adapters to `model`'s linear weights in place, keeping each targeted layer's base weight
    W0 (a copy, made when an adapter first reaches it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # weight name -> W0 [out, in]

    @torch.no_grad()
    def apply(self, named: Sequence[tuple[str, torch.Tensor]], scaling: float) -> int:
        """W = W0 + scaling * B @ A for every layer the adapter names; returns the adapter's bytes."""
        params = dict(self.model.named_parameters())
        pairs = adapter_pairs(named)
        for weight, (a, b) in pairs.items():
            if weight not in params:
                raise ValueError(f"adapter targets {weight!r}, which is not a weight of the engine's model")
            p = params[weight]
            if tuple(p.shape) != (b.shape[0], a.shape[1]):
                raise ValueError(
                    f"adapter for {weight!r} gives B @ A of {(b.shape[0], a.shape[1])}, the weight is {tuple(p.shape)}"
                )
        for weight, (a, b) in pairs.items():
            p = params[weight]
            base = self.base.setdefault(weight, p.detach().clone())
            delta = b.to(p.device, torch.float32) @ a.to(p.device, torch.float32)
            p.copy_((base.float() + scaling * delta).to(p.dtype))
        return nbytes(named)

    def forget(self, names: Iterable[str]) -> None:
        """Full weights were loaded for `names`: they are those layers' base weights now."""
        for name in names:
            self.base.pop(name, None)
