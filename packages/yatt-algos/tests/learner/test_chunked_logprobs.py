"""The hand-written backward of the chunked head (`learner/chunked_logprobs.py`): values and gradients equal
the checkpointed chunks and the full logits (bias, softcap and scale, temperature, a masked vocabulary entry,
a detached entropy, bf16); nothing of size [chunk, V] is saved for backward; and through peft LoRA (adapters
on the attention, and on the lm_head itself, which checkpoints) log-probs and every trainable gradient equal
the full-logits path to 1e-5 in fp32."""

from __future__ import annotations

import pytest
import torch
from yatt_algos.learner.chunked_logprobs import linear_token_outputs
from yatt_algos.learner.lm_head import LogitTransform, chunked_head, head_token_outputs
from yatt_algos.learner.torch_backend import causal_lm_forward, token_outputs
from yatt_algos.learner.torch_engine import apply_lora
from yatt_algos.types import LearnerConfig

from .conftest import tiny_lm


def _run(head, h, labels, *, weights, **kw):
    """(outputs, d/dhidden, d/dweight, d/dbias) of sum(outputs * weights)."""
    h = h.detach().requires_grad_()
    head.zero_grad(set_to_none=True)
    out = head_token_outputs(h, head, labels, **kw)
    (out * weights[..., : out.shape[-1]] if out.dim() == 2 else out * weights[:, 0]).sum().backward()
    bias = None if head.bias is None else head.bias.grad
    return out.detach(), h.grad, head.weight.grad, bias


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(
    "transform,temperature",
    [(LogitTransform(), 1.0), (LogitTransform(), 0.7), (LogitTransform(softcap=3.0, scale=1.5), 0.7)],
)
def test_function_equals_checkpointed_chunks(entropy, transform, temperature):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    h, labels = torch.randn(23, 16), torch.randint(0, 50, (23,))
    weights = torch.randn(23, 2)
    kw = dict(transform=transform, chunk_size=5, temperature=temperature, entropy=entropy, weights=weights)
    fn = _run(head, h, labels, recompute="function", **kw)
    ck = _run(head, h, labels, recompute="checkpoint", **kw)
    torch.testing.assert_close(fn[0], ck[0], atol=0, rtol=0)  # the same log_softmax: bit for bit
    for a, b, name in zip(fn[1:], ck[1:], ("hidden", "weight", "bias"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert float(fn[2].abs().sum()) > 1.0  # the gradient is not trivially zero


def test_a_masked_vocabulary_entry_and_a_detached_entropy():
    """A -inf logit (a banned token) has p = 0: the outputs and gradients are those of the vocabulary without
    it (fp64 reference), finite, and 0 on its row. (The checkpointed path's entropy gradient is NaN here:
    `value._entropy_of`'s bmm multiplies p = 0 by the lowest finite log p.)"""
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 30)
    with torch.no_grad():
        head.bias[7] = -torch.inf
    h, labels = torch.randn(9, 8), torch.randint(0, 30, (9,))
    labels[labels == 7] = 8
    keep = torch.arange(30) != 7
    for weights in (torch.randn(9, 2), torch.cat([torch.randn(9, 1), torch.zeros(9, 1)], dim=1)):
        out, g_h, g_w, g_b = _run(
            head,
            h,
            labels,
            recompute="function",
            transform=LogitTransform(),
            chunk_size=4,
            entropy=True,
            weights=weights,
        )
        h64 = h.double().requires_grad_()
        w64 = head.weight.detach()[keep].double().requires_grad_()
        b64 = head.bias.detach()[keep].double().requires_grad_()
        log_p = torch.log_softmax(h64 @ w64.T + b64, dim=-1)
        lp = log_p.gather(-1, (labels - (labels > 7).long())[:, None])[:, 0]
        ent = -(log_p.exp() * log_p).sum(-1)
        (lp * weights[:, 0] + ent * weights[:, 1]).sum().backward()
        torch.testing.assert_close(out, torch.stack([lp, ent], -1).float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(g_h, h64.grad.float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(g_w[keep], w64.grad.float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(g_b[keep], b64.grad.float(), atol=1e-5, rtol=0)
        assert float(g_w[7].abs().sum()) == 0.0 and float(g_b[7]) == 0.0


def test_bf16_matches_the_checkpointed_chunks():
    torch.manual_seed(2)
    head = torch.nn.Linear(32, 64, bias=False).bfloat16()
    h, labels = torch.randn(40, 32).bfloat16(), torch.randint(0, 64, (40,))
    kw = dict(
        transform=LogitTransform(), chunk_size=16, temperature=0.6, entropy=True, weights=torch.randn(40, 2)
    )
    fn = _run(head, h, labels, recompute="function", **kw)
    ck = _run(head, h, labels, recompute="checkpoint", **kw)
    torch.testing.assert_close(fn[0], ck[0], atol=0, rtol=0)
    assert fn[1].dtype == fn[2].dtype == torch.bfloat16
    for a, b in zip(fn[1:3], ck[1:3], strict=True):  # bf16 gradients: one rounding of the cast apart at most
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_nothing_of_vocabulary_size_is_saved_for_backward():
    torch.manual_seed(3)
    tokens, width, vocab = 64, 8, 1000
    weight = torch.randn(vocab, width, requires_grad=True)
    h, labels = torch.randn(tokens, width, requires_grad=True), torch.randint(0, vocab, (tokens,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = linear_token_outputs(
            h, weight, None, labels, transform=LogitTransform(), chunk_size=16, entropy=True
        )
    # hidden [64, 8], weight [1000, 8], labels [64], log-sum-exp [64]: no [16, 1000] chunk of logits
    assert sorted(saved) == [tokens, tokens, tokens * width, vocab * width]
    out.sum().backward()
    assert h.grad.shape == h.shape and weight.grad.shape == weight.shape


def _naive(model, mb, temperature):
    logits = model(
        input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long(), use_cache=False
    ).logits
    return token_outputs(logits, mb, chunk_size=1024, temperature=temperature, entropy="grad")


def _grads(model, out):
    loss = (out["logprobs"] * 0.7).sum() + (out["entropy"] * 1.3).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "lm_head")])
def test_peft_lora_equals_full_logits(targets):
    pytest.importorskip("peft", reason="LoRA goes through peft")
    cfg = LearnerConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=targets)
    model = apply_lora(tiny_lm(seed=6), cfg)
    torch.manual_seed(7)
    with torch.no_grad():  # peft starts B at 0: random adapters, so they change the log-probs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    head = chunked_head(model)  # found through peft's wrapper
    assert head is not None and ("lm_head" in targets) == (type(head.head) is not torch.nn.Linear)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(12)[None] < torch.tensor([12, 7, 9])[:, None]
    mb = {"input_ids": torch.randint(0, 128, (3, 12), generator=g) * mask, "attention_mask": mask}
    naive = _naive(model, mb, 0.8)
    chunked = causal_lm_forward(model, mb, chunk_size=5, temperature=0.8, entropy="grad")
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(chunked[key], naive[key], atol=1e-5, rtol=0)
    g_naive, g_chunked = _grads(model, naive), _grads(model, chunked)
    assert g_naive.keys() == g_chunked.keys() and all("lora_" in n for n in g_naive)
    assert any("lm_head" in n for n in g_naive) == ("lm_head" in targets)
    for name in g_naive:
        torch.testing.assert_close(g_chunked[name], g_naive[name], atol=1e-5, rtol=1e-5, msg=name)
