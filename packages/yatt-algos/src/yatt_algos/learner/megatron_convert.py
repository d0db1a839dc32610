"""HF <-> Megatron-Core weight conversion for Llama/Qwen2-style decoders, with tensor and pipeline splits.

Pure functions on state dicts; megatron-core is not imported. Megatron's layout (local layer spec):

- `linear_qkv` holds, for each of the G query groups in turn, that group's H/G query heads, then its key head,
  then its value head (rows of head_dim each); tensor parallel splits it by whole groups.
- `linear_fc1` is [gate; up]; tensor parallel splits gate and up separately and stacks each rank's halves.
- `linear_proj` and `linear_fc2` split by columns; word embeddings and the output layer by vocabulary rows.
- Layernorms and the final norm are replicated. Pipeline stage s holds layers [s L/P, (s+1) L/P) renumbered
  from 0; the embedding lives on the first stage, the final norm and output layer on the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class GPTArch:
    """The shape facts conversion needs, read from an HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    norm_eps: float
    max_positions: int


def arch_from_hf(config: Any) -> GPTArch:
    """GPTArch of an HF `LlamaConfig` or `Qwen2Config` (Qwen2 has q/k/v biases; Llama has `attention_bias`)."""
    if config.model_type not in ("llama", "qwen2"):
        raise ValueError(f"config.model_type {config.model_type!r} is not supported (llama, qwen2)")
    if config.model_type == "llama" and getattr(config, "mlp_bias", False):
        raise ValueError("config.mlp_bias=True is not supported")
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.rope_parameters rope_type {rope['rope_type']!r} is not supported (default)")
    return GPTArch(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_groups=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn_hidden_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        tied_embeddings=bool(config.tie_word_embeddings),
        qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        rope_theta=float(rope["rope_theta"]),
        norm_eps=float(config.rms_norm_eps),
        max_positions=config.max_position_embeddings,
    )


def check_parallel(arch: GPTArch, tp: int, pp: int) -> None:
    """ValueError unless groups, heads, ffn, vocabulary and layers divide by the parallel sizes."""
    for name, value, by in (
        ("num_key_value_heads", arch.num_groups, tp),
        ("intermediate_size", arch.ffn_hidden_size, tp),
        ("vocab_size", arch.vocab_size, tp),
        ("num_hidden_layers", arch.num_layers, pp),
    ):
        if value % by:
            raise ValueError(f"config.{name}={value} is not divisible by the parallel size {by}")


def _stage_layers(arch: GPTArch, pp_rank: int, pp: int) -> range:
    per = arch.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: GPTArch, tp_rank: int, tp: int):
    """[H*d, ...], [G*d, ...], [G*d, ...] -> this rank's interleaved [(G/tp)(H/G + 2) d, ...]."""
    g, d, per = arch.num_groups, arch.head_dim, arch.num_heads // arch.num_groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.chunk(tp, dim=0)[tp_rank].reshape(-1, *rest).clone()


def _qkv_to_hf(shards: list[torch.Tensor], arch: GPTArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, per = arch.num_groups, arch.head_dim, arch.num_heads // arch.num_groups
    rest = shards[0].shape[1:]
    fused = torch.cat(shards, dim=0).reshape(g, (per + 2) * d, *rest)
    q, k, v = fused.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(
    hf: StateDict, arch: GPTArch, *, tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1
) -> StateDict:
    """The Megatron state dict of pipeline stage `pp_rank`, tensor rank `tp_rank`, from a full HF one."""
    check_parallel(arch, tp, pp)
    out: StateDict = {}
    rows = lambda t: t.chunk(tp, dim=0)[tp_rank].clone()  # noqa: E731
    cols = lambda t: t.chunk(tp, dim=1)[tp_rank].clone()  # noqa: E731
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = rows(hf["model.embed_tokens.weight"])
    for local, layer in enumerate(_stage_layers(arch, pp_rank, pp)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            q, k, v = (hf[f"{attn}{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(q, k, v, arch, tp_rank, tp)
        out[dst + "self_attention.linear_proj.weight"] = cols(hf[attn + "o_proj.weight"])
        gate, up = rows(hf[src + "mlp.gate_proj.weight"]), rows(hf[src + "mlp.up_proj.weight"])
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = cols(hf[src + "mlp.down_proj.weight"])
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not arch.tied_embeddings:
            out["output_layer.weight"] = rows(hf["lm_head.weight"])
    return out


def megatron_stage_to_hf(
    stage: list[StateDict], arch: GPTArch, *, pp_rank: int = 0, pp: int = 1
) -> StateDict:
    """The HF tensors held by pipeline stage `pp_rank`, from its tensor ranks' state dicts `stage[tp_rank]`."""
    check_parallel(arch, len(stage), pp)
    out: StateDict = {}
    cat0 = lambda key: torch.cat([s[key] for s in stage], dim=0)  # noqa: E731
    cat1 = lambda key: torch.cat([s[key] for s in stage], dim=1)  # noqa: E731
    if pp_rank == 0:
        out["model.embed_tokens.weight"] = cat0("embedding.word_embeddings.weight")
    for local, layer in enumerate(_stage_layers(arch, pp_rank, pp)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        out[dst + "input_layernorm.weight"] = stage[0][src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = stage[0][src + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            q, k, v = _qkv_to_hf([s[f"{src}self_attention.linear_qkv.{kind}"] for s in stage], arch)
            for name, t in zip("qkv", (q, k, v), strict=True):
                out[f"{dst}self_attn.{name}_proj.{kind}"] = t
        out[dst + "self_attn.o_proj.weight"] = cat1(src + "self_attention.linear_proj.weight")
        fc1 = [s[src + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in stage]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([gate for gate, _ in fc1], dim=0)
        out[dst + "mlp.up_proj.weight"] = torch.cat([up for _, up in fc1], dim=0)
        out[dst + "mlp.down_proj.weight"] = cat1(src + "mlp.linear_fc2.weight")
    if pp_rank == pp - 1:
        out["model.norm.weight"] = stage[0]["decoder.final_layernorm.weight"]
        if not arch.tied_embeddings:
            out["lm_head.weight"] = cat0("output_layer.weight")
    return out


def megatron_to_hf(shards: list[list[StateDict]], arch: GPTArch) -> StateDict:
    """A full HF state dict from every stage's and tensor rank's Megatron state dict: shards[pp_rank][tp_rank]."""
    out: StateDict = {}
    for pp_rank, stage in enumerate(shards):
        out |= megatron_stage_to_hf(stage, arch, pp_rank=pp_rank, pp=len(shards))
    return out
