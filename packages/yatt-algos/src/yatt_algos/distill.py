"""On-policy distillation: per-token advantages from a teacher's log-probabilities of the student's samples.

The student samples y ~ pi_s; a frozen teacher pi_t scores every sampled token. The per-token reverse KL
estimate on a sampled token is k1 = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t) (Schulman's k1 of
`yatt_algos.kl`, with the teacher as the reference); its sequence sum is an unbiased estimate of
KL(pi_s || pi_t). Minimising the reverse KL with the policy gradient gives each token the advantage
A_t = -(log pi_s - log pi_t), optionally plus a task reward r (one per sequence, on every response token)
times a coefficient: A_t = -(log pi_s - log pi_t) + c * r. This is the "on-policy distillation" of Agarwal et
al. (GKD, arXiv 2306.13649, with the sampled-token reverse KL) and of Thinking Machines' Tinker write-up (2025):
per-token, undiscounted (each token's own KL only, no future terms: the write-up's choice, a departure from the
full REINFORCE return of the sequence KL), trained with the same clipped importance-ratio losses as RL.

Pure functions on torch tensors; shapes in the docstrings. Padding and prompt tokens (mask 0) get advantage 0.
"""

from __future__ import annotations

import torch

from yatt_algos.checks import as_bool_mask, check_rows, check_same_shape


def reverse_kl_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward: torch.Tensor | None = None,
    reward_coef: float = 0.0,
    baseline: bool = False,
    kl_coef: float = 1.0,
) -> torch.Tensor:
    """A_t = -kl_coef * (student_logprobs - teacher_logprobs) + reward_coef * reward on response tokens, 0
    elsewhere (kl_coef 0: the task reward's share only, where the KL is a loss of its own: `distill_topk`);
    with `baseline`, minus the mean of A over every response token of the batch (a constant baseline: the
    expected gradient is unchanged, its variance smaller, since on a student far from its teacher nearly every
    sampled token's A is negative; a departure from the write-up, which uses none).

    student_logprobs, teacher_logprobs: [B, T] log-probs of the sampled tokens (the student's from the
    sampling policy); response_mask: [B, T] 1 on the tokens the student generated; reward: [B] task reward
    per sequence (required when reward_coef != 0). Returns [B, T] float32, detached (an advantage is a
    constant of the loss)."""
    check_same_shape(
        "student_logprobs", {"student_logprobs": student_logprobs, "teacher_logprobs": teacher_logprobs}
    )
    check_same_shape(
        "student_logprobs", {"student_logprobs": student_logprobs, "response_mask": response_mask}
    )
    mask = as_bool_mask("response_mask", response_mask)
    advantages = -kl_coef * (student_logprobs.detach().float() - teacher_logprobs.detach().float())
    if reward_coef:
        if reward is None:
            raise ValueError("reward_coef is set but reward (one task reward per sequence, [B]) is None")
        check_rows("reward", reward, student_logprobs.shape[0])
        advantages = advantages + reward_coef * reward.detach().float()[:, None]
    if baseline and mask.any():
        advantages = advantages - advantages[mask].mean()
    return torch.where(mask, advantages, torch.zeros_like(advantages))


def reverse_kl_sums(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Sums for the metrics, to be added across data-parallel ranks before dividing: `reverse_kl_sum` (of
    log pi_s - log pi_t over response tokens), `teacher_logprob_sum` and `num_tokens`. All [B, T] in.
    `reverse_kl` = reverse_kl_sum / num_tokens is the per-token mean of the k1 estimate (it can be negative
    on a batch; its expectation under the student is >= 0)."""
    check_same_shape(
        "student_logprobs",
        {
            "student_logprobs": student_logprobs,
            "teacher_logprobs": teacher_logprobs,
            "response_mask": response_mask,
        },
    )
    mask = as_bool_mask("response_mask", response_mask)
    diff = (student_logprobs.float() - teacher_logprobs.float())[mask]
    return {
        "reverse_kl_sum": float(diff.sum()),
        "teacher_logprob_sum": float(teacher_logprobs.float()[mask].sum()),
        "num_tokens": float(mask.sum()),
    }


def reverse_kl(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """The per-token mean of log pi_s - log pi_t over response tokens ([B, T] in; 0.0 without any token)."""
    sums = reverse_kl_sums(student_logprobs, teacher_logprobs, response_mask)
    return sums["reverse_kl_sum"] / max(sums["num_tokens"], 1.0)
