"""Log-probs and entropy through a linear output projection, chunk by chunk, with a hand-written backward.

`linear_token_outputs(hidden [N, H], weight [V, H], bias [V] | None, labels [N])` gives what
`lm_head.head_token_outputs` gives for a plain `nn.Linear` head, as one `torch.autograd.Function` (the way
fused linear-cross-entropy kernels work): forward computes each chunk's logits [chunk, V], their
log-softmax, the label's log-prob and the entropy, and keeps only the inputs plus one float per token (the
log-sum-exp). Backward recomputes a chunk's logits and turns them in place into the gradient
of the logits,

    d lp / dz = g_lp * (onehot(label) - p),    d H / dz = -g_ent * p * (log p + H),

then multiplies by the weight (the hidden states' gradient) and accumulates the weight's (and bias')
gradient. So a chunk needs at most two [chunk, V] fp32 buffers in forward and backward (plus one in the
model's dtype when it is not fp32), where checkpointing the same chunk holds about five (the recomputed
logits, the log-softmax, its exp, autograd's gradient buffers): `bench_learner.py` measures both.

The operations are the model's and `token_outputs`' in the same order (projection in the model's dtype, the
final transform, the temperature, fp32, log-softmax), so values and gradients equal the full-logits path to
fp32 rounding. Not covered here (the caller checkpoints instead): a sum_pi_squared output that needs a
gradient, and autocast regions.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

_FP32_MIN = torch.finfo(torch.float32).min


class Transform(Protocol):
    """The model's final logit transform (`lm_head.LogitTransform`): softcap then scale."""

    @property
    def softcap(self) -> float | None: ...

    @property
    def scale(self) -> float | None: ...

    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...


def _logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: Transform,
    temperature: float,
) -> tuple[torch.Tensor, bool]:
    """[c, H] -> (fp32 logits [c, V] exactly as the model and `token_outputs` compute them, whether a -inf was
    replaced by the lowest finite float). The result is a fresh buffer the caller may overwrite in place."""
    z = transform(F.linear(h, weight, bias))  # the model's dtype
    if temperature != 1.0:
        z = z / temperature
    z = z.float()  # F.linear allocated z: in fp32 this is that buffer, which the caller owns
    neg_inf = bool(z.amin() == -torch.inf)
    if neg_inf:  # a masked vocabulary entry: p = 0 and p log p = 0, as `value._fp32_finite` makes it
        z.masked_fill_(torch.isneginf(z), _FP32_MIN)
    return z, neg_inf


def _chunk_forward(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: Transform,
    temperature: float,
    labels: torch.Tensor,
    entropy: bool,
    sum_pi_squared: bool,
) -> tuple[torch.Tensor, ...]:
    """A chunk's hidden states [c, H] -> (log-prob [c], log-sum-exp [c], then entropy [c] and
    sum_v pi(v)^2 [c] where asked). torch.log_softmax, as `token_outputs` calls it, so the values are the
    full-logits path's bit for bit; the log-sum-exp is what backward needs to rebuild log p from z."""
    z = _logits(h, weight, bias, transform, temperature)[0]
    lse = torch.logsumexp(z, dim=-1)
    log_p = torch.log_softmax(z, dim=-1)
    del z  # the only reference: at most two [c, V] buffers live from here on (log p and p)
    label = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not (entropy or sum_pi_squared):
        return label, lse
    p = log_p.exp()
    ent = -torch.bmm(p.unsqueeze(1), log_p.unsqueeze(-1)).view(-1)  # -sum p log p without a third buffer
    if not sum_pi_squared:
        return label, lse, ent
    return label, lse, ent, p.square_().sum(-1)


def _transform_backward(
    g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform
) -> torch.Tensor:
    """The gradient through `LogitTransform` (softcap, then scale), in place on g [c, V]."""
    if transform.scale is not None:
        g.mul_(transform.scale)
    if transform.softcap is not None:
        t = torch.tanh(F.linear(h, weight, bias) / transform.softcap)  # d(c tanh(x / c))/dx = 1 - tanh^2
        g.mul_(t.square_().neg_().add_(1.0))
    return g


class _LinearTokenOutputs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, labels [N]) -> [N, 2] (log-prob, entropy) or [N]
    log-probs; saves the inputs and [N] statistics only."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        transform: Transform,
        temperature: float,
        chunk_size: int,
        entropy: bool,
    ) -> torch.Tensor:
        label, lse, ent = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            h, lab = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            stats = _chunk_forward(h, weight, bias, transform, temperature, lab, entropy, False)
            label.append(stats[0])
            lse.append(stats[1])
            if entropy:
                ent.append(stats[2])
        lse_all = torch.cat(lse)
        ent_all = torch.cat(ent) if entropy else lse_all.new_zeros(0)
        ctx.save_for_backward(hidden, weight, bias, labels, lse_all)
        ctx.options = (transform, temperature, chunk_size, entropy)
        return torch.stack([torch.cat(label), ent_all], dim=-1) if entropy else torch.cat(label)

    @staticmethod
    @once_differentiable  # the gradient is computed by hand, not by autograd: no double backward
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        transform, temperature, chunk_size, entropy = ctx.options
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        g_lp = grad_out[:, 0] if entropy else grad_out
        entropy = entropy and bool(grad_out[:, 1].any())  # a detached entropy (a metric) needs no term
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b and bias is not None else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            z, neg_inf = _logits(h, weight, bias, transform, temperature)
            log_p = z.sub_(lse[start:end].unsqueeze(-1))
            masked = log_p <= _FP32_MIN / 2 if neg_inf else None  # the replaced -inf entries: gradient 0
            gl = g_lp[start:end].unsqueeze(-1)
            if entropy:
                # -p (g_lp + g_ent (log p + H)) = -(g_lp + g_ent H) p - g_ent p log p, with H summed again here:
                # the forward's bmm sum is off by ~1e-4 at V = 151,936 and would shift every p's coefficient
                ge = grad_out[start:end, 1:]
                p_log_p = log_p.exp().mul_(log_p)
                coef = p_log_p.sum(-1, keepdim=True).mul_(-ge).add_(gl)  # g_lp + g_ent H
                g = log_p.exp_().mul_(coef).add_(p_log_p.mul_(ge)).neg_()
                del p_log_p
            else:
                g = log_p.exp_().mul_(-gl)
            g.scatter_add_(-1, labels[start:end].unsqueeze(-1), gl)  # + g_lp at the label
            if masked is not None:
                g.masked_fill_(masked, 0.0)
            g = g.to(weight.dtype)  # autograd's cast back to the model's dtype (no copy in fp32)
            if temperature != 1.0:
                g.div_(temperature)
            g = _transform_backward(g, h, weight, bias, transform)
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[start:end])
            if grad_w is not None:
                grad_w.addmm_(g.t(), h)
            if grad_b is not None:
                grad_b.add_(g.sum(0))
            del g, z, log_p
        return grad_h, grad_w, grad_b, None, None, None, None, None


def linear_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    transform: Transform,
    chunk_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
    sum_pi_squared: bool = False,
) -> torch.Tensor:
    """Per-token log-prob of `labels` [N] under logits = transform(hidden @ weight.T + bias) / temperature,
    `chunk_size` tokens at a time: [N] fp32, or [N, 2] (log-prob, entropy) with `entropy`, or [N, 3]
    (log-prob, entropy, sum_v pi(v)^2) with `sum_pi_squared` (no gradient: the caller checkpoints when it
    needs one). Differentiable in hidden, weight and bias without keeping any [N, V] tensor."""
    if sum_pi_squared:
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            raise ValueError("linear_token_outputs gives sum_pi_squared without a gradient only")
        outs = []
        for start in range(0, hidden.shape[0], chunk_size):
            h, lab = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            label, _, ent, spi = _chunk_forward(h, weight, bias, transform, temperature, lab, True, True)
            outs.append(torch.stack([label, ent, spi], dim=-1))
        return torch.cat(outs) if outs else hidden.new_zeros((0, 3), dtype=torch.float32)
    if hidden.shape[0] == 0:
        return hidden.new_zeros((0, 2) if entropy else (0,), dtype=torch.float32)
    out = _LinearTokenOutputs.apply(hidden, weight, bias, labels, transform, temperature, chunk_size, entropy)
    return out
