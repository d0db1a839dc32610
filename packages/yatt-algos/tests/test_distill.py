"""On-policy distillation advantages and metrics (yatt_algos.distill) against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from yatt_algos.distill import reverse_kl, reverse_kl_advantages, reverse_kl_sums

STUDENT = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.25, -3.0, 0.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -4.0, -0.5, -9.0], [-1.25, -1.0, -7.0, 0.0]])
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])


def test_advantages_are_the_negative_log_ratio_on_response_tokens() -> None:
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK)
    # -(s - t) on mask 1, 0 on prompt/padding: row 0 tokens 1..3: -(-2+4)=-2, 0, -(0+9)=-9
    expected = torch.tensor([[0.0, -2.0, 0.0, -9.0], [-1.0, 2.0, 0.0, 0.0]])
    assert torch.equal(adv, expected)
    assert adv.dtype == torch.float32 and not adv.requires_grad


def test_reward_is_added_per_sequence_times_its_coefficient() -> None:
    reward = torch.tensor([1.0, 0.0])
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK, reward=reward, reward_coef=0.5)
    expected = torch.tensor([[0.0, -1.5, 0.5, -8.5], [-1.0, 2.0, 0.0, 0.0]])
    assert torch.equal(adv, expected)
    # coefficient 0 (the default) ignores the reward entirely
    plain = reverse_kl_advantages(STUDENT, TEACHER, MASK)
    assert torch.equal(reverse_kl_advantages(STUDENT, TEACHER, MASK, reward=reward), plain)


def test_gradients_do_not_flow_through_advantages() -> None:
    student = STUDENT.clone().requires_grad_(True)
    adv = reverse_kl_advantages(student, TEACHER, MASK)
    assert adv.grad_fn is None


def test_metrics_are_token_means_over_the_mask() -> None:
    sums = reverse_kl_sums(STUDENT, TEACHER, MASK)
    # diffs on mask: 2, 0, 9, 1, -2 -> sum 10 over 5 tokens; teacher: -4 - 0.5 - 9 - 1.25 - 1 = -15.75
    assert sums == {"reverse_kl_sum": 10.0, "teacher_logprob_sum": -15.75, "num_tokens": 5.0}
    assert reverse_kl(STUDENT, TEACHER, MASK) == 2.0
    assert reverse_kl(STUDENT, TEACHER, torch.zeros_like(MASK)) == 0.0


def test_bad_inputs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="teacher_logprobs has shape"):
        reverse_kl_advantages(STUDENT, TEACHER[:, :3], MASK)
    with pytest.raises(ValueError, match="reward_coef is set but reward"):
        reverse_kl_advantages(STUDENT, TEACHER, MASK, reward_coef=1.0)
    with pytest.raises(ValueError, match=r"reward must have shape \(2,\)"):
        reverse_kl_advantages(STUDENT, TEACHER, MASK, reward=torch.ones(3), reward_coef=1.0)
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        reverse_kl_advantages(STUDENT, TEACHER, MASK * 2)


def test_baseline_subtracts_the_mean_over_response_tokens() -> None:
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK, baseline=True)
    # the advantages on the mask, -2, 0, -9, -1, 2, have mean -2; padding and prompt stay 0
    expected = torch.tensor([[0.0, 0.0, 2.0, -7.0], [1.0, 4.0, 0.0, 0.0]])
    assert torch.equal(adv, expected)
    assert float(adv[MASK.bool()].sum()) == 0.0


def test_kl_coef_zero_keeps_only_the_reward_share() -> None:
    """kl_coef 0 (distill.topk: the KL is a loss of its own): A_t = reward_coef * r - its token mean."""
    reward = torch.tensor([1.0, 0.0])
    adv = reverse_kl_advantages(
        STUDENT, TEACHER, MASK, reward=reward, reward_coef=2.0, kl_coef=0.0, baseline=True
    )
    # 2 on row 0's three tokens, 0 on row 1's two: mean 6 / 5 = 1.2
    expected = torch.tensor([[0.0, 0.8, 0.8, 0.8], [-1.2, -1.2, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert bool((reverse_kl_advantages(STUDENT, TEACHER, MASK, kl_coef=0.0) == 0).all())
