"""The names ported from verl reach the learner's computation: one `TorchPolicyLearner.update` per config on
the tiny model reports exactly the loss of the named functions applied by hand to the same logprobs, and
that loss differs from PPO-clip's."""

import pytest
import torch
from yatt_algos.advantages import ADVANTAGE_ESTIMATORS
from yatt_algos.aggregation import aggregate
from yatt_algos.kl import kl_penalty
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.policy_losses import POLICY_LOSSES
from yatt_algos.types import AlgoConfig, OptimConfig

pytest.importorskip("transformers", reason="the tiny test models are HF models")

OPTIM = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)


def _hand_logprobs(model, batch):
    """log p(ids[t] | ids[:t]) at position t, 0 at t = 0 and at padding. [B, T]"""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[
        ..., 0
    ]
    return torch.cat([torch.zeros(picked.shape[0], 1), picked], dim=1) * batch["attention_mask"]


@pytest.fixture(scope="module")
def verl_batch(tiny):
    """8 sequences in 4 prompt groups, OPO advantages from 0/1 scores, old and rollout logprobs near the
    model's own, reference logprobs for the KL term."""
    batch = tiny.batch(seed=5)
    with torch.no_grad():
        lp = _hand_logprobs(tiny.lm(0), batch)
    g = torch.Generator().manual_seed(6)
    mask = batch["response_mask"]
    batch["old_logprobs"] = torch.where(mask, lp + 0.2 * torch.randn(lp.shape, generator=g), 0.0)
    batch["rollout_logprobs"] = torch.where(
        mask, batch["old_logprobs"] + 0.3 * torch.randn(lp.shape, generator=g), 0.0
    )
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    batch["advantages"], _ = ADVANTAGE_ESTIMATORS["opo"](scores, mask, AlgoConfig(), group_ids=group_ids)
    batch["group_ids"] = group_ids
    return batch


def _hand_loss(tiny, batch, algo):
    """The objective the learner should compute, from the registries, on the whole batch (one mini-batch)."""
    with torch.no_grad():
        lp = _hand_logprobs(tiny.lm(0), batch)
    mask = batch["response_mask"]
    per_token, _ = POLICY_LOSSES[algo.policy_loss](
        lp, batch["old_logprobs"], batch["advantages"], mask, algo, rollout_logprobs=batch["rollout_logprobs"]
    )
    loss = aggregate(per_token, mask, algo.loss_agg_mode)
    kl = aggregate(kl_penalty(lp, batch["ref_logprobs"], algo.kl_estimator), mask, algo.loss_agg_mode)
    return float(loss + algo.kl_loss_coef * kl)


@pytest.mark.parametrize(
    "algo",
    [
        AlgoConfig(
            policy_loss="gmpo", loss_agg_mode="seq-mean-token-mean", kl_estimator="k3+", kl_loss_coef=0.1
        ),
        AlgoConfig(
            policy_loss="dppo_tv",
            loss_agg_mode="token-sum",
            kl_estimator="abs",
            kl_loss_coef=0.1,
            rollout_is_level="token",
            rollout_is_mode="mask",
            rollout_is_threshold_lower=0.8,
            rollout_rs_level="sequence",
            rollout_rs_threshold=3.0,
        ),
    ],
    ids=["gmpo", "dppo_tv"],
)
def test_a_verl_name_reaches_the_update(tiny, verl_batch, algo):
    import msgspec

    learner = TorchPolicyLearner(tiny.lm(0), algo=algo, optim_config=OPTIM)
    before = tiny.params(learner.model)
    stats = learner.update(verl_batch)
    assert stats.loss == pytest.approx(_hand_loss(tiny, verl_batch, algo), rel=1e-5, abs=1e-6)
    assert torch.isfinite(torch.tensor(stats.grad_norm)) and tiny.diff(tiny.params(learner.model), before) > 0
    ppo = msgspec.structs.replace(algo, policy_loss="ppo_clip")
    assert abs(stats.loss - _hand_loss(tiny, verl_batch, ppo)) > 1e-3
    if algo.rollout_rs_level != "none":
        assert 0.0 < stats.metrics["rollout_rs_seq_masked_frac"] < 1.0  # some sequences were rejected
