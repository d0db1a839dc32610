"""The output head of a causal LM, chunk by chunk: log-probs and entropy without the full [B, T, V] logits.

A 150k-250k vocabulary makes the logits of a micro-batch the largest tensor of a training step (4,096 tokens
x 151,936 x 4 bytes = 2.4 GiB in fp32, and several of them live at once in backward). Here the model runs to
its final hidden states only (the output projection is swapped for a module that keeps its input), then the
projection, the model's final logit transform, the temperature and the log-softmax run over `chunk_size`
tokens at a time, and backward recomputes each chunk's logits instead of keeping them, so at most one
chunk's [chunk, V] tensors exist at once (as fused linear-cross-entropy kernels do). A plain `nn.Linear`
head goes through `chunked_logprobs.linear_token_outputs` (a hand-written backward: two [chunk, V] buffers);
any other head module (a peft LoRA-adapted `lm_head`) runs per chunk under activation checkpointing.

The model's top-level forward still runs (DDP and FSDP2 hooks, peft wrappers); only the projection moves. The
chunk performs the same operations as the model's forward followed by `token_outputs`, so results are equal
to the full-logits path (bit for bit in fp32 up to matmul blocking).

A model type whose final transform this module does not know (`CHUNKED_HEAD_MODEL_TYPES`), or that has no
`lm_head` module, takes the full logits with a warning: never wrong log-probs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from yatt_algos.learner.chunked_logprobs import linear_token_outputs
from yatt_algos.value import _both_chunk, _entropy_of, _fp32_finite, _logprobs_chunk

# model_type -> the final logit transform its CausalLM forward applies after `lm_head` (read in transformers'
# modeling_<type>.py): "none", "softcap" (Gemma 2: cap * tanh(x / cap), config.final_logit_softcapping) or
# "scale" (Cohere: x * model.logit_scale)
CHUNKED_HEAD_MODEL_TYPES: dict[str, str] = {
    "qwen2": "none",
    "qwen3": "none",
    "qwen2_moe": "none",
    "qwen3_moe": "none",
    "llama": "none",
    "mistral": "none",
    "gemma": "none",
    "qwen2_vl": "none",
    "qwen2_5_vl": "none",
    "gemma2": "softcap",
    "cohere": "scale",
}


# at most this many logits per chunk (256 MiB in fp32; 441 tokens at Qwen2's 151,936 vocabulary): the
# hand-written backward holds 2 such [chunk, V] buffers at once (a checkpointed chunk ~5), so the head's peak
# stays ~0.6 GiB (~1.3 GiB) whatever the chunk_size
MAX_CHUNK_LOGITS = 1 << 26


def _with_sum_pi_squared(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N, V], [N] -> [N, 3]: log-prob of the label, entropy, sum_v pi(v)^2 (the optimal token baseline's
    input), from one log-softmax."""
    log_p = torch.log_softmax(_fp32_finite(logits), dim=-1)
    label = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return torch.stack([label, _entropy_of(log_p), log_p.exp().square().sum(-1)], dim=-1)


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to `lm_head`'s output before returning logits: softcapping and/or scaling."""

    softcap: float | None = None
    scale: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N, V], the same operations in the same order as the model's forward."""
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale is not None:
            logits = logits * self.scale
        return logits


@dataclass(frozen=True)
class ChunkedHead:
    """The HF model whose `lm_head` is swapped during the backbone forward, and its final transform."""

    inner: torch.nn.Module
    head: torch.nn.Module  # inner.lm_head: an nn.Linear, or a wrapper of one (peft LoRA)
    transform: LogitTransform


def unwrap_hf(model: torch.nn.Module) -> torch.nn.Module:
    """The HF CausalLM inside DDP and peft wrappers (FSDP2 keeps the model's own object)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def chunked_head(model: torch.nn.Module) -> ChunkedHead | None:
    """The head to chunk, or None (with a warning) when the model's final transform is unknown here."""
    inner = unwrap_hf(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    kind = CHUNKED_HEAD_MODEL_TYPES.get(str(model_type))
    head = getattr(inner, "lm_head", None)
    reason = None
    if kind is None:
        reason = f"model type {model_type!r} is not in CHUNKED_HEAD_MODEL_TYPES (its final logit transform is unknown)"
    elif not isinstance(head, torch.nn.Module) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        reason = f"its lm_head is a {type(head).__name__}, not a module with a [V, H] weight"
    if reason is not None or not isinstance(head, torch.nn.Module):
        warnings.warn(
            f"{type(inner).__name__}: {reason}; computing log-probs from the full [B, T, V] logits",
            stacklevel=3,
        )
        return None
    if kind == "softcap":
        cap = getattr(config, "final_logit_softcapping", None)
        transform = LogitTransform(softcap=None if cap is None else float(cap))
    elif kind == "scale":
        scale = inner.logit_scale  # Cohere keeps config.logit_scale as a float attribute
        transform = LogitTransform(scale=float(scale))
    else:
        transform = LogitTransform()
    return ChunkedHead(inner=inner, head=head, transform=transform)


class _KeepHidden(torch.nn.Module):
    """Stands in for `lm_head` during the backbone forward: keeps the hidden states [b, t, H] and returns an
    empty [b, t, 0] tensor, so the model computes no logits."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden[..., :0]


@contextlib.contextmanager
def hidden_states_only(inner: torch.nn.Module) -> Iterator[_KeepHidden]:
    """Within the block, `inner`'s forward returns no logits and the final hidden states land in the yielded
    module's `.hidden`. The real `lm_head` is restored on exit, also on error."""
    head, keep = inner.lm_head, _KeepHidden()
    inner.lm_head = keep  # nn.Module.__setattr__ registers it in place of the head
    try:
        yield keep
    finally:
        inner.lm_head = head


def head_token_outputs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    *,
    transform: LogitTransform,
    chunk_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
    sum_pi_squared: bool = False,
    max_chunk_elements: int = MAX_CHUNK_LOGITS,
    recompute: str = "auto",
) -> torch.Tensor:
    """Per-token log-prob of `labels` (and entropy) from final hidden states, `chunk_size` tokens at a time.

    hidden [N, H] (model dtype), labels [N] int -> [N] fp32 log-probs, or [N, 2] (log-prob, entropy) when
    `entropy`, or [N, 3] (log-prob, entropy, sum_v pi(v)^2) when `sum_pi_squared`. Each chunk computes logits
    [chunk, V] = transform(head(hidden)) / temperature and its log-softmax; backward recomputes them, so no
    [N, V] tensor is ever allocated. A chunk holds at most `max_chunk_elements` logits (fewer tokens than
    `chunk_size` at a large vocabulary). `recompute`: "function" (`chunked_logprobs`' hand-written backward;
    a plain `nn.Linear` head only), "checkpoint" (activation checkpointing per chunk, any head module) or
    "auto" (the function where it applies).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if recompute not in ("auto", "function", "checkpoint"):
        raise ValueError(f"recompute must be 'auto', 'function' or 'checkpoint', got {recompute!r}")
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    chunk_size = max(1, min(chunk_size, max_chunk_elements // weight.shape[0]))
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and labels [N], got {tuple(hidden.shape)}, {tuple(labels.shape)}"
        )
    trainable = hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    grad = torch.is_grad_enabled() and trainable
    # the hand-written backward knows F.linear only, gives sum_pi_squared without a gradient, and does not
    # replay autocast; anything else checkpoints the chunk (the same values, ~5 [chunk, V] buffers)
    plain = type(head) is torch.nn.Linear and not torch.is_autocast_enabled(hidden.device.type)
    if recompute == "function" or (recompute == "auto" and plain and not (sum_pi_squared and grad)):
        if not plain:
            raise ValueError(
                f"recompute='function' needs a plain torch.nn.Linear head, got {type(head).__name__}"
            )
        bias = head.bias
        assert bias is None or isinstance(bias, torch.Tensor)
        return linear_token_outputs(
            hidden,
            weight,
            bias,
            labels,
            transform=transform,
            chunk_size=chunk_size,
            temperature=temperature,
            entropy=entropy or sum_pi_squared,
            sum_pi_squared=sum_pi_squared,
        )
    stat = _with_sum_pi_squared if sum_pi_squared else _both_chunk if entropy else _logprobs_chunk
    width = 3 if sum_pi_squared else 2 if entropy else 0

    def chunk(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        logits = transform(head(h))  # [chunk, V] in the model's dtype, as the model computes it
        if temperature != 1.0:
            logits = logits / temperature
        return stat(logits, lab)

    outs = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, lab = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        # non-reentrant checkpointing sends the gradient to the head's parameters without passing them
        outs.append(checkpoint(chunk, h, lab, use_reentrant=False) if grad else chunk(h, lab))
    if not outs:
        return hidden.new_zeros((0, width) if width else (0,), dtype=torch.float32)
    return torch.cat(outs)
