"""The dense on-policy distillation loss (yatt_algos.distill_topk): the top-k + tail reverse KL against
hand-computed values and the full KL, the teacher's and the student's chunked forwards against a plain
full-logits forward (values and gradients), and one learner update against the reference loss."""

from __future__ import annotations

import math

import pytest
import torch
from yatt_algos.distill_topk import (
    student_topk_outputs,
    teacher_topk,
    teacher_topk_outputs,
    topk_kl,
    update_topk,
)
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import AlgoConfig, OptimConfig

from .conftest import make_batch, tiny_lm


def test_topk_and_tail_of_a_hand_distribution() -> None:
    teacher = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log()
    ids, values = teacher_topk(teacher, 2)
    assert ids.tolist() == [[0, 1]] or ids.tolist() == [[0, 2]]  # 0.2 ties: either one
    torch.testing.assert_close(values, torch.tensor([[0.5, 0.2, 0.3]]).log())
    # the student's coarsened distribution over {0, 1, rest}: 0.25, 0.25, 0.5
    student = torch.tensor([[0.25, 0.25, 0.25, 0.25]]).log()
    ids = torch.tensor([[0, 1]])
    kl = topk_kl(student, ids, torch.tensor([[0.5, 0.2, 0.3]]).log())
    expected = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.2) + 0.5 * math.log(0.5 / 0.3)
    assert kl.item() == pytest.approx(expected, abs=1e-6)


def test_topk_kl_is_the_full_kl_at_k_vocab_minus_one_and_a_lower_bound_below() -> None:
    g = torch.Generator().manual_seed(0)
    student = torch.randn(6, 9, generator=g).log_softmax(-1)
    teacher = torch.randn(6, 9, generator=g).log_softmax(-1)
    full = (student.exp() * (student - teacher)).sum(-1)
    torch.testing.assert_close(topk_kl(student, *teacher_topk(teacher, 8)), full, rtol=0, atol=1e-6)
    for k in (1, 3, 5):
        assert bool((topk_kl(student, *teacher_topk(teacher, k)) <= full + 1e-6).all())
    # the same distribution: 0
    assert topk_kl(teacher, *teacher_topk(teacher, 3)).abs().max() < 1e-6


def test_bad_shapes_and_k_are_refused() -> None:
    lp = torch.zeros(2, 5).log_softmax(-1)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        teacher_topk(lp, 5)
    ids, values = teacher_topk(lp, 2)
    with pytest.raises(ValueError, match=r"teacher_values must be \[N, k \+ 1\]"):
        topk_kl(lp, ids, values[:, :2])


def _reference(model: torch.nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax [B, T - 1, V] of a plain full-logits forward (position i predicts token i + 1)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    return (logits[:, :-1].float() / temperature).log_softmax(-1)


@pytest.mark.parametrize("chunked", [True, False])
def test_forwards_equal_a_full_logits_forward_in_values_and_gradients(chunked, monkeypatch) -> None:
    """Teacher top-k, the student's KL_t, sampled log-probs and entropy at every response token equal the
    same computed from a plain forward's full logits; the gradients of sum KL_t too. `chunked` False takes the
    full-logits fallback (a head `lm_head.chunked_head` cannot chunk)."""
    if not chunked:
        import yatt_algos.learner.lm_head as lm_head

        monkeypatch.setattr(lm_head, "chunked_head", lambda model: None)
    batch = {k: v for k, v in make_batch(seed=1, num_seqs=4).items() if k.endswith(("ids", "mask"))}
    student, teacher = tiny_lm(seed=0), tiny_lm(seed=1)
    sel = batch["response_mask"][:, 1:]
    k = 7
    out = teacher_topk_outputs(teacher, batch, k, chunk_size=5, temperature=0.5)
    with torch.no_grad():
        t_lp = _reference(teacher, batch, temperature=0.5)
    ids, values = teacher_topk(t_lp[sel], k)
    assert torch.equal(out["topk_ids"][:, 1:][sel], ids)
    torch.testing.assert_close(out["topk_values"][:, 1:][sel], values, rtol=0, atol=1e-5)
    labels = batch["input_ids"][:, 1:][sel]
    picked = t_lp[sel].gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(out["logprobs"][:, 1:][sel], picked, rtol=0, atol=1e-5)
    assert bool((out["topk_ids"][:, 1:][~sel] == 0).all()) and bool((out["logprobs"][:, 0] == 0).all())

    got = student_topk_outputs(student, batch, out["topk_ids"], out["topk_values"], chunk_size=5)
    s_lp = _reference(student, batch)[sel]
    want = topk_kl(s_lp, ids, values)
    torch.testing.assert_close(got["topk_kl"][:, 1:][sel], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        got["logprobs"][:, 1:][sel], s_lp.gather(-1, labels[:, None])[:, 0], rtol=0, atol=1e-5
    )
    torch.testing.assert_close(got["entropy"][:, 1:][sel], -(s_lp.exp() * s_lp).sum(-1), rtol=0, atol=1e-5)
    assert bool((got["topk_kl"][:, 1:][~sel] == 0).all())
    params = [p for p in student.parameters() if p.requires_grad]
    grads = torch.autograd.grad(got["topk_kl"].sum(), params)
    ref = torch.autograd.grad(want.sum(), params, allow_unused=True)
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-4, atol=1e-6)


def test_update_minimises_the_token_mean_kl() -> None:
    """`update_topk` with zero advantages: its loss is the token-mean KL_t of the reference forward at the
    starting weights (the first pass), and ten updates on the same batch cut it by more than half."""
    batch = make_batch(seed=2, num_seqs=6)
    student, teacher = tiny_lm(seed=0), tiny_lm(seed=1)
    out = teacher_topk_outputs(teacher, batch, 8, chunk_size=64)
    sel = batch["response_mask"][:, 1:]
    with torch.no_grad():
        start = topk_kl(
            _reference(student, batch)[sel], out["topk_ids"][:, 1:][sel], out["topk_values"][:, 1:][sel]
        ).mean()
    learner = TorchPolicyLearner(
        student,
        algo=AlgoConfig(loss_agg_mode="token-mean", kl_loss_coef=0.0),
        optim_config=OptimConfig(lr=3e-3, micro_batch_size=4, num_warmup_steps=0, num_training_steps=10),
    )
    experience = {**batch, "advantages": torch.zeros_like(batch["advantages"])}
    losses = [update_topk(learner, experience, out["topk_ids"], out["topk_values"]) for _ in range(10)]
    assert losses[0].loss == pytest.approx(float(start), rel=1e-5)
    assert losses[0].metrics["topk_kl"] == pytest.approx(float(start), rel=1e-5)
    assert losses[0].metrics["pg_loss"] == 0.0  # no task reward: the advantages are 0
    assert losses[-1].loss < 0.5 * losses[0].loss
    with pytest.raises(ValueError, match=r"teacher_ids must be \[B, T, k\]"):
        update_topk(learner, experience, out["topk_ids"][:, :-1], out["topk_values"])
