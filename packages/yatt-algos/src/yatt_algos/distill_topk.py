"""On-policy distillation with a dense teacher signal: at every position of the student's own samples, the
reverse KL between the student's whole next-token distribution and the teacher's, over the teacher's top-k
tokens plus one "tail" bucket for every other token.

The sampled-token estimate of `yatt_algos.distill` grades one token per position: log pi_s(y_t) - log pi_t(y_t)
with y_t ~ pi_s, whose policy gradient is, in expectation over y_t, the gradient of the per-position reverse
KL(pi_s(. | y_<t) || pi_t(. | y_<t)). Here that expectation is taken exactly instead (GKD, Agarwal et al.,
arXiv 2306.13649, section 3, on-policy with the reverse KL; Thinking Machines' on-policy distillation write-up,
2025, names it the lower-variance variant): the loss at position t is

    KL_t = sum_{v in S_t} p_s(v) (log p_s(v) - log p_t(v)) + p_s(R) (log p_s(R) - log p_t(R))

where S_t is the teacher's k most likely tokens at t, R the rest of the vocabulary (p(R) = 1 - sum_S p), both
distributions given the same prefix (the student's sampled y_<t). KL_t is the exact KL of the two
distributions coarsened to k + 1 outcomes: a lower bound of the full KL, equal to it when k + 1 >= V (or when
the teacher puts no mass outside its top k). The teacher sends only its k ids, k log-probs and its tail
log-prob per position (k + 1 floats instead of V). Its gradient flows through the student's log-softmax, so
every token of S_t (and the tail's mass) moves at once, whatever token was sampled.

Departures: no importance ratio or clipping (the prefixes are fixed samples; KL_t is a per-position divergence
like SFT's cross-entropy on them, so a second update on the same batch just minimises it further), and no
future terms (each position's own KL only, as the per-token advantage of `yatt_algos.distill`).

Pure functions on torch tensors plus the student's chunked forward; shapes in the docstrings. Alignment as
the learners': position t of a [B, T] tensor is about token t, predicted from the logits at t - 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.learner.update_loop import Normalizer
    from yatt_algos.types import AlgoConfig, TrainStats

DIRECTIONS = ("reverse", "forward")  # KL(student || teacher), KL(teacher || student)

# a tail log-prob below this is treated as an empty tail (no mass outside the top k): clamping keeps
# p * (log p - log q) finite (exp(-1e4) == 0 in fp32) where both sides would otherwise be -inf
_TAIL_FLOOR = -1e4


def teacher_topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most likely tokens and their log-probs, and the log-prob of all the others together.

    logprobs: [..., V] log-softmax of the teacher's logits (at its temperature); 1 <= k < V (k = V - 1 leaves a
    one-token tail: the KL is then the full one). Returns (ids [..., k] int64, sorted by log-prob descending;
    values [..., k + 1] float32: the k log-probs, then log p(tail) = log sum of the other tokens' p)."""
    vocab = logprobs.shape[-1]
    if not 1 <= k < vocab:
        raise ValueError(f"k must be in [1, {vocab - 1}] (below the vocabulary size {vocab}), got {k}")
    lp = logprobs.float()
    top, ids = lp.topk(k, dim=-1)
    tail = lp.scatter(-1, ids, -torch.inf).logsumexp(-1, keepdim=True)
    return ids, torch.cat([top, tail.clamp(min=_TAIL_FLOOR)], dim=-1)


def topk_kl(
    student_logprobs: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_values: torch.Tensor,
    *,
    direction: str = "reverse",
) -> torch.Tensor:
    """KL_t of the module docstring at each position: the student's full distribution against the teacher's
    top-k + tail, both coarsened to the teacher's k ids and the rest. `direction` "reverse": KL(student ||
    teacher) (the module docstring's); "forward": KL(teacher || student) = sum p_t (log p_t - log p_s), whose
    gradient is the cross-entropy's on the teacher's soft labels (GKD's beta = 0: mass-covering, where the
    reverse KL is mode-seeking).

    student_logprobs: [N, V] the student's log-softmax (with grad); teacher_ids: [N, k] int; teacher_values:
    [N, k + 1] (`teacher_topk`'s values). Returns [N] float32, >= 0 up to rounding."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if student_logprobs.dim() != 2 or teacher_ids.shape != (student_logprobs.shape[0], teacher_ids.shape[-1]):
        raise ValueError(
            f"student_logprobs must be [N, V] and teacher_ids [N, k], got {tuple(student_logprobs.shape)} and "
            f"{tuple(teacher_ids.shape)}"
        )
    if teacher_values.shape != (teacher_ids.shape[0], teacher_ids.shape[1] + 1):
        raise ValueError(
            f"teacher_values must be [N, k + 1] = {(teacher_ids.shape[0], teacher_ids.shape[1] + 1)} "
            f"(k log-probs and the tail's), got {tuple(teacher_values.shape)}"
        )
    ids = teacher_ids.long()
    student = student_logprobs.float()
    top = student.gather(-1, ids)  # [N, k]
    tail = student.scatter(-1, ids, -torch.inf).logsumexp(-1, keepdim=True).clamp(min=_TAIL_FLOOR)
    s = torch.cat([top, tail], dim=-1)  # [N, k + 1]: the student's coarsened log-probs
    t = teacher_values.float()
    return (s.exp() * (s - t)).sum(-1) if direction == "reverse" else (t.exp() * (t - s)).sum(-1)


def response_head(
    model: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    fn: Callable[..., torch.Tensor],
    per_position: tuple[torch.Tensor, ...],
    *,
    chunk_size: int,
) -> torch.Tensor:
    """`fn(logits [n, V], labels [n], *per_position [n, ...]) -> [n, ...]` over the response positions of a
    micro-batch, in order (N of them: where response_mask [b, t] is 1, position 0 excluded), logits being the
    model's (the ones that predict those tokens, its final transform applied). Returns fn's rows, [N, ...].

    The backbone runs once; the head and `fn` run on response positions only, `chunk_size` at a time under
    activation checkpointing when grad is on (`learner.lm_head`'s scheme: no [b, t, V] logits), or on the full
    logits where the model's head cannot be chunked (`lm_head.chunked_head` warns). `per_position` tensors
    are [b, t, ...] aligned like logprobs (position t: about token t, given tokens < t)."""
    from yatt_algos.learner.lm_head import MAX_CHUNK_LOGITS, chunked_head, hidden_states_only

    kwargs: dict[str, Any] = {
        "input_ids": mb["input_ids"],
        "attention_mask": mb["attention_mask"].long(),
        "use_cache": False,
    }
    sel = mb["response_mask"][:, 1:].bool()  # [b, t - 1]: position i + 1 is a response token
    labels = mb["input_ids"][:, 1:][sel]  # [N]
    rows = [x[:, 1:][sel] for x in per_position]  # each [N, ...]
    head = chunked_head(model)
    # a plain linear head is sliced here; an unknown model, or a peft LoRA-wrapped lm_head, gives full logits
    if head is None or not isinstance(head.head, torch.nn.Linear):
        return fn(model(**kwargs).logits[:, :-1][sel], labels, *rows)
    linear: torch.nn.Linear = head.head
    with hidden_states_only(head.inner) as keep:
        model(**kwargs)
    if keep.hidden is None:
        raise RuntimeError(f"{type(head.inner).__name__}'s forward did not call its lm_head")
    hidden = keep.hidden[:, :-1][sel]  # [N, H]: the states that predict the response tokens
    weight, bias, transform = linear.weight, linear.bias, head.transform
    size = max(1, min(chunk_size, MAX_CHUNK_LOGITS // linear.out_features))

    def chunk(h: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return fn(transform(F.linear(h, w, bias)), *rest)

    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, hidden.shape[0], size):
        part = slice(start, start + size)
        args = (hidden[part], weight, labels[part], *(x[part] for x in rows))
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
    if not parts:
        return fn(hidden.new_zeros(0, linear.out_features), labels, *rows)
    return torch.cat(parts)


def scatter_response(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """`response_head`'s rows [N, ...] laid back on the batch: [b, t, ...], 0 off the response (differentiable)."""
    sel = response_mask[:, 1:].bool()
    full = values.new_zeros(*sel.shape, *values.shape[1:])
    full[sel] = values
    return F.pad(full, (0, 0) * (values.dim() - 1) + (1, 0))


def student_topk_outputs(
    model: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    teacher_ids: torch.Tensor,
    teacher_values: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    direction: str = "reverse",
) -> dict[str, torch.Tensor]:
    """The student's forward for the dense loss on one micro-batch, each [b, t], 0 off the response tokens,
    with grad when grad is enabled: "topk_kl" (KL_t), "logprobs" (of the sampled token) and "entropy" (of the
    student's next-token distribution); that distribution is softmax(logits / temperature).

    mb: input_ids, attention_mask, response_mask [b, t]; teacher_ids [b, t, k] and teacher_values [b, t, k + 1]
    (`teacher_topk`'s, aligned like logprobs); `direction`: `topk_kl`'s."""

    def kl_and_logprob(logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, values: torch.Tensor):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [n, V]
        picked = lp.gather(-1, labels[:, None].long())[:, 0]
        entropy = -(lp.exp() * lp).sum(-1)
        kl = topk_kl(lp, ids, values, direction=direction)
        return torch.stack([kl, picked, entropy], dim=-1)  # [n, 3]

    out = response_head(model, mb, kl_and_logprob, (teacher_ids, teacher_values), chunk_size=chunk_size)
    full = scatter_response(out, mb["response_mask"])  # [b, t, 3]
    return {"topk_kl": full[..., 0], "logprobs": full[..., 1], "entropy": full[..., 2]}


def teacher_topk_outputs(
    model: torch.nn.Module, mb: dict[str, torch.Tensor], k: int, *, chunk_size: int, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """The teacher's side, no grad: at each response token of the micro-batch, "logprobs" [b, t] (of the
    sampled token), "topk_ids" [b, t, k] and "topk_values" [b, t, k + 1] (`teacher_topk` of softmax(logits /
    temperature)); 0 off the response."""

    def topk(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        ids, values = teacher_topk(lp, k)
        picked = lp.gather(-1, labels[:, None].long())
        return torch.cat([picked, values, ids.float()], dim=-1)  # [n, 2k + 2]; ids < 2^24 are exact in fp32

    with torch.no_grad():
        full = scatter_response(
            response_head(model, mb, topk, (), chunk_size=chunk_size), mb["response_mask"]
        )
    return {
        "logprobs": full[..., 0],
        "topk_values": full[..., 1 : k + 2],
        "topk_ids": full[..., k + 2 :].long(),
    }


def topk_objective(
    out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], algo: AlgoConfig, norm: Normalizer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the loss: the RL policy loss on the batch's advantages (the task reward's
    share, if any: the KL is not in them) plus KL_t aggregated by `algo.loss_agg_mode` under `norm` (as
    `learner.update_loop.policy_objective` aggregates its terms). out: `student_topk_outputs`'s [b, t]."""
    from yatt_algos.aggregation import aggregate
    from yatt_algos.learner.update_loop import policy_objective

    loss, metrics = policy_objective(out["logprobs"], out["entropy"], mb, algo, norm)
    mask = mb["response_mask"]
    kl = aggregate(
        out["topk_kl"],
        mask,
        algo.loss_agg_mode,
        num_tokens=norm.num_tokens,
        num_seqs=norm.num_seqs,
        max_len=norm.max_len,
    )
    local = float(mask.sum())  # MetricSums re-weights a metric by this micro-batch's tokens
    share = norm.num_tokens / local if local else 0.0
    return loss + kl, {**metrics, "topk_kl": kl.detach() * share}


def update_topk(
    learner: TorchPolicyLearner,
    experience: dict[str, torch.Tensor],
    teacher_ids: torch.Tensor,
    teacher_values: torch.Tensor,
    *,
    direction: str = "reverse",
) -> TrainStats:
    """One update of a torch policy learner with `topk_objective` (epochs, mini- and micro-batches, data
    parallel and the guarded step as every update: `TorchEngine.update`). experience: the policy update's
    [B, T] fields (input_ids, attention_mask, response_mask, old_logprobs, advantages, ...); teacher_ids
    [B, T, k], teacher_values [B, T, k + 1] (`teacher_topk`'s, aligned like logprobs), looked up per
    micro-batch by row; `direction`: `topk_kl`'s."""
    engine = learner.engine
    b, t = experience["input_ids"].shape
    if teacher_ids.shape[:2] != (b, t) or teacher_values.shape != (b, t, teacher_ids.shape[-1] + 1):
        raise ValueError(
            f"teacher_ids must be [B, T, k] and teacher_values [B, T, k + 1] with [B, T] = {(b, t)}, got "
            f"{tuple(teacher_ids.shape)} and {tuple(teacher_values.shape)}"
        )
    cfg = engine.learner

    def forward(model: torch.nn.Module, mb: dict[str, torch.Tensor], grad: bool) -> dict[str, torch.Tensor]:
        rows, width, dev = mb["row_index"].cpu(), mb["input_ids"].shape[1], mb["input_ids"].device
        ids, values = teacher_ids[rows, :width].to(dev), teacher_values[rows, :width].to(dev)
        with torch.set_grad_enabled(grad):
            return student_topk_outputs(
                model,
                mb,
                ids,
                values,
                chunk_size=cfg.logits_chunk_size,
                temperature=cfg.temperature,
                direction=direction,
            )

    def objective(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], norm: Normalizer):
        return topk_objective(out, mb, engine.algo, norm)

    batch = {**experience, "row_index": torch.arange(b)}
    return engine.update(batch, forward, objective, ("response_mask", "old_logprobs", "advantages"))
