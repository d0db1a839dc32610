"""Property tests (hypothesis): shapes, masks and finiteness across random batches, and the algebraic
invariants (micro-batch additivity, zero-sum group advantages, k3 >= 0, B^T lambda = mu, vote nesting)."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")  # a test extra: the package itself needs only torch
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from yatt_algos.advantages import ADVANTAGE_ESTIMATORS  # noqa: E402
from yatt_algos.aggregation import AGG_MODES, aggregate  # noqa: E402
from yatt_algos.bone_soup import backbone_matrix, merge_coefficients  # noqa: E402
from yatt_algos.capo import vote_wrong_steps  # noqa: E402
from yatt_algos.kl import kl_penalty  # noqa: E402
from yatt_algos.policy_losses import POLICY_LOSSES  # noqa: E402
from yatt_algos.types import AlgoConfig  # noqa: E402

FAST = settings(max_examples=25, deadline=None)


@st.composite
def batches(draw):
    """(seed, B, T, mask [B, T] with at least one token per row)."""
    b, t = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    starts = [draw(st.integers(0, t - n)) for n in lengths]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        mask[i, s : s + n] = True
    return draw(st.integers(0, 2**16)), mask


@FAST
@given(batches(), st.sampled_from(sorted(AGG_MODES)), st.integers(1, 5))
def test_aggregate_is_additive_over_row_splits(batch, mode, cut):
    seed, mask = batch
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float(mask.shape[0]), "max_len": mask.shape[1]}
    full = aggregate(values, mask, mode)
    cut = min(cut, mask.shape[0])
    parts = aggregate(values[:cut], mask[:cut], mode, **counts) + (
        aggregate(values[cut:], mask[cut:], mode, **counts) if cut < mask.shape[0] else 0.0
    )
    assert torch.isfinite(full)
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-6)


_CORRECTIONS = [
    AlgoConfig(rollout_is_level="sequence"),
    AlgoConfig(rollout_is_level="token", rollout_is_mode="mask", rollout_is_threshold_lower=0.5),
    AlgoConfig(rollout_is_level="sequence", rollout_is_batch_normalize=True, rollout_rs_level="token"),
    AlgoConfig(rollout_rs_level="sequence", clip_cov_ratio=0.5, kl_cov_ratio=0.5, clip_cov_lb=-1.0),
]


@FAST
@given(batches(), st.sampled_from(sorted(POLICY_LOSSES)), st.floats(0.0, 5.0), st.sampled_from(_CORRECTIONS))
def test_policy_losses_finite_and_masked(batch, name, scale, cfg):
    seed, mask = batch
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=gen) * 5
    logprobs = (old + scale * torch.randn(mask.shape, generator=gen)).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=gen) * 3
    rollout = old + 0.1 * torch.randn(mask.shape, generator=gen)
    loss, metrics = POLICY_LOSSES[name](logprobs, old, adv, mask, cfg, rollout_logprobs=rollout)
    aggregate(loss, mask, "token-mean").backward()
    assert loss.shape == mask.shape and torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    assert (loss[~mask] == 0).all() and (logprobs.grad[~mask] == 0).all()
    assert all(torch.isfinite(v) and v.dim() == 0 for v in metrics.values())
    assert 0.0 <= metrics["clip_frac"].item() <= 1.0


@FAST
@given(
    batches(),
    st.sampled_from(
        ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "gdpo"]
    ),
    st.booleans(),
)
def test_group_advantages_finite_zero_sum_and_masked(batch, name, binary):
    seed, mask = batch
    gen = torch.Generator().manual_seed(seed)
    b = mask.shape[0]
    scores = torch.randint(0, 2, (b,), generator=gen).float() if binary else torch.randn(b, generator=gen)
    groups = torch.randint(0, 3, (b,), generator=gen) * 7 - 5
    adv, returns = ADVANTAGE_ESTIMATORS[name](scores, mask, AlgoConfig(), group_ids=groups)
    assert adv.shape == mask.shape and torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert (adv[~mask] == 0).all()
    if name in ("grpo", "rloo", "gpg"):
        for g in groups.unique():
            first = adv[groups == g].sum(dim=-1) / mask[groups == g].sum(dim=-1)  # the row's advantage
            assert first.sum().item() == pytest.approx(0.0, abs=1e-4)


@FAST
@given(
    st.lists(st.floats(-60, 60), min_size=1, max_size=20),
    st.lists(st.floats(-60, 60), min_size=1, max_size=20),
)
def test_k3_nonnegative_and_bounded(a, b):
    n = min(len(a), len(b))
    out = kl_penalty(torch.tensor([a[:n]]), torch.tensor([b[:n]]), "k3")
    assert torch.isfinite(out).all() and (out >= 0).all() and (out <= 10).all()


@FAST
@given(st.integers(2, 6), st.floats(0.55, 1.0), st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6))
def test_bone_soup_coefficients_reproduce_mu(n, beta, raw):
    weights = torch.tensor(raw[:n], dtype=torch.float64) + 1e-3
    mu = weights / weights.sum()
    b = backbone_matrix(n, beta)
    lam = merge_coefficients(b, mu)
    torch.testing.assert_close(b.T @ lam, mu)
    assert lam.sum().item() == pytest.approx(1.0)


@FAST
@given(st.lists(st.sets(st.integers(0, 7), max_size=5), min_size=1, max_size=6))
def test_votes_nest(critiques):
    inter = set(vote_wrong_steps(critiques, "intersection"))
    major = set(vote_wrong_steps(critiques, "majority"))
    union = set(vote_wrong_steps(critiques, "union"))
    average = vote_wrong_steps(critiques, "average")
    assert inter <= major <= union == set(average)
    assert all(0 < w <= 1 for w in average.values())
