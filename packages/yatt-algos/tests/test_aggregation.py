"""Loss aggregation: hand-worked values per mode, micro-batch/data-parallel accumulation equivalence, bad input."""

import pytest
import torch
from yatt_algos.aggregation import AGG_MODES, aggregate

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 seqs
        ("seq-mean-token-mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 = (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (1 + 2 + 4) / (2 seqs * T = 3)
    ],
)
def test_hand_worked(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_global_counts_and_max_len():
    # 7 / 10 tokens; 7 / 4 seqs; Dr.GRPO with max_len 4: 7 / (2 * 4)
    assert aggregate(VALUES, MASK, "token-mean", num_tokens=10).item() == pytest.approx(0.7)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(1.75)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx(7 / 8)


def test_padding_never_contributes():
    poisoned = VALUES.clone()
    poisoned[0, 2] = float("nan")
    poisoned[1, 1] = float("inf")
    for mode in AGG_MODES:
        assert aggregate(poisoned, MASK, mode).item() == pytest.approx(aggregate(VALUES, MASK, mode).item())


def _micro_batches(features, lengths, sizes):
    """Split rows into micro-batches of `sizes` rows, each trimmed to its own longest row (uneven T)."""
    out, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        t = int(lengths[rows].max())
        mask = torch.arange(t).unsqueeze(0) < lengths[rows].unsqueeze(-1)
        out.append((features[rows, :t], mask))
        start += size
    return out


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_accumulation_equals_one_batch(mode):
    """4 micro-batches of uneven sizes and lengths, each aggregated with the global counts, summed (as
    gradient accumulation and the data-parallel all-reduce sum them), give the one-batch gradient."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 9, 1, 5, 12, 2, 7, 4])
    t_max = int(lengths.max())
    features = torch.randn(8, t_max, 5, generator=gen)
    weight = torch.randn(5, generator=gen, requires_grad=True)
    full_mask = torch.arange(t_max).unsqueeze(0) < lengths.unsqueeze(-1)

    aggregate((features @ weight).square(), full_mask, mode).backward()
    expected = weight.grad.clone()
    weight.grad = None

    counts = {"num_tokens": float(full_mask.sum()), "num_seqs": 8.0, "max_len": t_max}
    total = 0.0
    for feats, mask in _micro_batches(features, lengths, [1, 3, 2, 2]):
        loss = aggregate((feats @ weight).square(), mask, mode, **counts)
        loss.backward()
        total += loss.item()
    torch.testing.assert_close(weight.grad, expected, rtol=1e-5, atol=1e-6)
    full = aggregate((features @ weight).square(), full_mask, mode).item()
    assert total == pytest.approx(full, rel=1e-5)


def test_empty_micro_batch_with_global_counts_is_zero():
    loss = aggregate(VALUES, torch.zeros(2, 3), "token-mean", num_tokens=5, num_seqs=2)
    assert loss.item() == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match=r"mode 'mean' is not one of"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\), expected \(2, 3\) like values"):
        aggregate(VALUES, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match=r"values must be \[B, T\], got shape \(3,\)"):
        aggregate(VALUES[0], MASK[0], "token-mean")
    with pytest.raises(ValueError, match=r"num_tokens must be > 0, got 0\.0 \(is the mask all zeros\?\)"):
        aggregate(VALUES, torch.zeros(2, 3), "token-mean")
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        aggregate(VALUES, MASK * 2, "token-mean")


def test_registries_match_the_config_literals():
    from typing import get_args

    from yatt_algos.advantages import ADVANTAGE_ESTIMATORS
    from yatt_algos.kl import KL_ESTIMATORS
    from yatt_algos.pf_ppo import PF_PPO_WEIGHTS
    from yatt_algos.policy_losses import POLICY_LOSSES
    from yatt_algos.types import AdvantageEstimator, KLEstimator, LossAggMode, PfPpoMethod, PolicyLoss

    # every name a config accepts reaches a function, and every registered function is selectable
    assert sorted(AGG_MODES) == sorted(get_args(LossAggMode))
    assert sorted(KL_ESTIMATORS) == sorted(get_args(KLEstimator))
    assert sorted(POLICY_LOSSES) == sorted(get_args(PolicyLoss))
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(get_args(AdvantageEstimator))
    assert sorted(PF_PPO_WEIGHTS) == sorted(set(get_args(PfPpoMethod)) - {"none"})
