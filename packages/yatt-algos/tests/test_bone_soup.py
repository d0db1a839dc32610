"""Bone Soup: the backbone matrix, merging coefficients (the paper's worked example), fp32 state-dict
merging with negative coefficients, extrapolation from the SFT model."""

import pytest
import torch
from yatt_algos.bone_soup import (
    backbone_matrix,
    bone_soup_merge,
    extrapolation_factor,
    merge_coefficients,
    merge_state_dicts,
)


def test_backbone_matrix_hand_worked():
    # n = 3, beta 0.6: 0.6 on the diagonal, (1 - 0.6) / 2 = 0.2 elsewhere
    b = backbone_matrix(3, 0.6)
    torch.testing.assert_close(
        b, torch.tensor([[0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6]], dtype=torch.float64)
    )
    torch.testing.assert_close(b.sum(dim=1), torch.ones(3, dtype=torch.float64))


def test_merge_coefficients_worked_example():
    # PAPERS.md: rows (0.3, 0.7), (0.7, 0.3): 0.3 a + 0.7 b = 1 and 0.7 a + 0.3 b = 0 give a = -0.75, b = 1.75
    b = backbone_matrix(2, 0.3)
    torch.testing.assert_close(
        merge_coefficients(b, [1.0, 0.0]), torch.tensor([-0.75, 1.75], dtype=torch.float64)
    )
    torch.testing.assert_close(
        merge_coefficients(b, [0.5, 0.5]), torch.tensor([0.5, 0.5], dtype=torch.float64)
    )


def test_b_lambda_reproduces_mu():
    b = backbone_matrix(4, 0.7)
    mu = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    lam = merge_coefficients(b, mu)
    torch.testing.assert_close(b.T @ lam, mu)
    assert lam.sum().item() == pytest.approx(1.0)


def test_merge_state_dicts_fp32_negative_coefficients():
    # -0.75 [1, 2] + 1.75 [3, -1] = [4.5, -3.25]; the int buffer is equal and copied
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "step": torch.tensor([7])}
    b = {"w": torch.tensor([3.0, -1.0], dtype=torch.bfloat16), "step": torch.tensor([7])}
    out = merge_state_dicts([a, b], [-0.75, 1.75])
    assert out["w"].dtype == torch.bfloat16 and out["w"].tolist() == [4.5, -3.25]
    assert out["step"].tolist() == [7]


def test_merge_accumulates_in_fp32():
    # bf16 cannot hold 1 + 2^-9; accumulating in bf16 would lose the small terms: 256 * 2^-9 = 0.5
    small = {"w": torch.full((1,), 2.0**-9, dtype=torch.bfloat16)}
    one = {"w": torch.ones(1, dtype=torch.bfloat16)}
    out = merge_state_dicts([one] + [small] * 256, [1.0] + [1.0] * 256)
    assert out["w"].item() == 1.5


def test_bone_soup_merge_with_extrapolation():
    # a = 0.5 -> k = 2: backbones become sft + 2 (theta - sft) = [2, 4], [6, -2];
    # lambda (-0.75, 1.75): -0.75 [2, 4] + 1.75 [6, -2] = [9, -6.5]
    sft = {"w": torch.zeros(2)}
    backbones = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, -1.0])}]
    assert extrapolation_factor(0.5) == 2.0
    out = bone_soup_merge(backbones, [1.0, 0.0], beta=0.3, sft=sft, alphas=[0.5, 0.5])
    torch.testing.assert_close(out["w"], torch.tensor([9.0, -6.5]))
    plain = bone_soup_merge(backbones, [1.0, 0.0], beta=0.3)
    torch.testing.assert_close(plain["w"], torch.tensor([4.5, -3.25]))


def test_bad_input():
    with pytest.raises(ValueError, match="beta = 1/2 makes B singular"):
        backbone_matrix(2, 0.5)
    with pytest.raises(ValueError, match="num_objectives must be >= 2, got 1"):
        backbone_matrix(1, 0.8)
    with pytest.raises(ValueError, match=r"preference must be on the simplex \(>= 0, sum 1\)"):
        merge_coefficients(backbone_matrix(2, 0.8), [0.7, 0.7])
    with pytest.raises(ValueError, match="preference must have 2 entries"):
        merge_coefficients(backbone_matrix(2, 0.8), [1.0])
    with pytest.raises(
        ValueError,
        match=r"state_dicts\[1\] keys differ from state_dicts\[0\]: missing \['w'\], extra \['v'\]",
    ):
        merge_state_dicts([{"w": torch.zeros(1)}, {"v": torch.zeros(1)}], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"w: state_dicts\[1\] has shape \(2,\), expected \(1,\)"):
        merge_state_dicts([{"w": torch.zeros(1)}, {"w": torch.zeros(2)}], [0.5, 0.5])
    with pytest.raises(ValueError, match="coefficients has 1 entries for 2 state dicts"):
        merge_state_dicts([{"w": torch.zeros(1)}, {"w": torch.zeros(1)}], [1.0])
    with pytest.raises(ValueError, match="step: non-float tensors differ"):
        merge_state_dicts([{"step": torch.tensor([1])}, {"step": torch.tensor([2])}], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\), got 1.0"):
        extrapolation_factor(1.0)
