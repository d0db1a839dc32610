"""Group statistics by id and the rollout/train mismatch weights, called directly."""

import math

import pytest
import torch
from yatt_algos.groups import group_mean_std, group_token_mean_std
from yatt_algos.rollout_correction import rollout_is_weights


def test_group_mean_std_hand_worked():
    # ids 10 and -2 interleaved: group 10 = (1, 3) -> mean 2, unbiased std sqrt(2) = 1.414214;
    # group -2 = (5) alone -> mean 5, std 0 (not NaN)
    mean, std, size = group_mean_std(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([10, -2, 10]))
    torch.testing.assert_close(mean, torch.tensor([2.0, 5.0, 2.0]))
    torch.testing.assert_close(std, torch.tensor([math.sqrt(2.0), 0.0, math.sqrt(2.0)]))
    torch.testing.assert_close(size, torch.tensor([2.0, 1.0, 2.0]))


def test_group_token_mean_std_hand_worked():
    # one group over tokens (1, 2) + (3): mean 2, unbiased var ((1 + 0 + 1) / 2) = 1; padding ignored
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    mean, std, count = group_token_mean_std(values, mask, torch.tensor([0, 0]))
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(std, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(count, torch.tensor([3.0, 3.0]))


def test_rollout_is_weights_hand_worked():
    # log w = old - rollout = (ln 3, ln 0.5, <masked>); token level, truncate at 2: (2, 0.5, 1)
    old = torch.tensor([[0.0, -1.0, 0.0]])
    rollout = torch.tensor([[-math.log(3.0), -1.0 + math.log(2.0), 5.0]])
    mask = torch.tensor([[True, True, False]])
    w, m = rollout_is_weights(old, rollout, mask, level="token", mode="truncate", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert m["rollout_is_mean"].item() == pytest.approx(1.25)  # (2 + 0.5) / 2
    assert m["rollout_is_over_frac"].item() == pytest.approx(0.5)
    # k3 of KL(rollout || old) with x = log(old / rollout) = (ln 3, ln 0.5): (3 - ln 3 - 1 + 0.5 - ln 0.5 - 1) / 2
    expected = (3 - math.log(3) - 1 + 0.5 - math.log(0.5) - 1) / 2
    assert m["rollout_mismatch_k3"].item() == pytest.approx(expected, rel=1e-5)
    # sequence level: product 3 * 0.5 = 1.5 <= 2, kept on both tokens
    w, _ = rollout_is_weights(old, rollout, mask, level="sequence", mode="mask", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.0]]))
    with pytest.raises(ValueError, match="level must be 'token' or 'sequence', got 'seq'"):
        rollout_is_weights(old, rollout, mask, level="seq", mode="mask", threshold=2.0)
    with pytest.raises(ValueError, match="mode must be 'truncate' or 'mask', got 'clip'"):
        rollout_is_weights(old, rollout, mask, level="token", mode="clip", threshold=2.0)
