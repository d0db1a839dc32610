"""DAPO filters and shaping: dynamic sampling over non-contiguous groups, the overlong penalty, masking
truncated responses."""

import pytest
import torch
from yatt_algos.filters import dynamic_sampling_filter, mask_truncated, overlong_penalty


def test_dynamic_sampling_keeps_varied_groups():
    # group 9: (1, 0) varied -> kept; group 2: (1, 1) all equal -> dropped; group 5: (0.5) alone -> dropped;
    # group 4: (0, 0, 0.25) varied -> kept. Rows interleave the groups.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.25])
    groups = torch.tensor([9, 2, 9, 5, 2, 4, 4, 4])
    out = dynamic_sampling_filter(rewards, groups)
    assert out.keep.tolist() == [True, False, True, False, False, True, True, True]
    assert (out.kept_groups, out.dropped_groups) == ([4, 9], [2, 5])
    assert (out.num_kept, out.num_dropped) == (2, 2)
    # a tolerance treats near-equal rewards as equal: group 4's spread 0.25 is not > 0.3
    assert dynamic_sampling_filter(rewards, groups, atol=0.3).kept_groups == [9]


def test_dynamic_sampling_bad_input():
    with pytest.raises(ValueError, match=r"group_ids must have shape \(3,\), got \(2,\)"):
        dynamic_sampling_filter(torch.zeros(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="group_ids is empty: there are no groups"):
        dynamic_sampling_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards must be finite"):
        dynamic_sampling_filter(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"rewards must be \[B\], got shape \(2, 1\)"):
        dynamic_sampling_filter(torch.zeros(2, 1), torch.tensor([0, 0]))


def test_overlong_penalty_hand_worked():
    # max_len 20, buffer 4 -> L = 16: 10 -> 0; 16 -> 0; 18 -> (16 - 18) / 4 = -0.5; 20 -> -1; 25 -> -1
    lengths = torch.tensor([10, 16, 18, 20, 25])
    out = overlong_penalty(lengths, max_len=20, buffer_len=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        overlong_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=0.5),
        torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]),
    )
    assert overlong_penalty(lengths, max_len=20, buffer_len=0).abs().sum().item() == 0.0
    with pytest.raises(ValueError, match=r"buffer_len must be in \[0, max_len=20\], got 21"):
        overlong_penalty(lengths, max_len=20, buffer_len=21)


def test_mask_truncated():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    out, num = mask_truncated(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [0, 1, 1]] and out.dtype == mask.dtype and num == 1
    with pytest.raises(ValueError, match=r"truncated must have shape \(3,\), got \(2,\)"):
        mask_truncated(mask, torch.tensor([False, True]))
