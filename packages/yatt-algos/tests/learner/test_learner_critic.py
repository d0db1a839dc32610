"""The critic learner (value head on a token-classification model) against a hand-written clipped value step."""

import pytest
import torch
from yatt_algos.learner.torch_backend import TorchCriticLearner
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig

pytest.importorskip("transformers", reason="the tiny test models are HF models")

# eps 1e-6: see test_learner_torch.OPTIM
OPTIM = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)


def _hand_values(model, batch):
    """values[t] = head(hidden[t - 1]): the value of the state before token t; 0 at t = 0 and at padding."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits[..., 0]
    return torch.nn.functional.pad(out[:, :-1], (1, 0)) * batch["attention_mask"]


def test_compute_values_and_one_update_match_hand_written(tiny):
    batch = tiny.batch(seed=5)
    ref = tiny.critic(0)
    with torch.no_grad():
        v0 = _hand_values(ref, batch)
    # old values: the model's own plus an offset, so that some tokens hit the 0.2 clip
    batch["old_values"] = torch.where(batch["response_mask"], v0 + 0.3 * torch.sin(torch.arange(24.0)), 0.0)
    learner = TorchCriticLearner(
        tiny.critic(0), algo=AlgoConfig(), optim_config=OPTIM, learner=LearnerConfig()
    )
    assert torch.allclose(learner.compute_values(batch), v0, atol=1e-6, rtol=0)

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    v = _hand_values(ref, batch)
    old, ret, mask = batch["old_values"], batch["returns"], batch["response_mask"].float()
    clipped = old + (v - old).clamp(-0.2, 0.2)
    per_token = 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    loss = (per_token * mask).sum() / mask.sum()
    clip_frac = (((clipped - ret) ** 2 > (v - ret) ** 2).float() * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()

    stats = learner.update(batch)
    assert stats.loss == pytest.approx(loss.item(), abs=1e-6)
    assert stats.metrics["vf_clip_frac"] == pytest.approx(clip_frac.item(), abs=1e-6)
    assert 0 < stats.metrics["vf_clip_frac"] < 1
    assert tiny.diff(tiny.params(learner.model), tiny.params(ref)) < 1e-5


def test_critic_fits_returns_over_steps(tiny):
    """A fixed-seed trajectory: repeated updates toward fixed returns drive the value loss down."""
    batch = tiny.batch(seed=6)
    cfg = OptimConfig(lr=3e-3, micro_batch_size=8, clip_grad_norm=1.0)
    learner = TorchCriticLearner(
        tiny.critic(0), algo=AlgoConfig(), optim_config=cfg, learner=LearnerConfig(value_clip_range=10.0)
    )
    losses = []
    for _ in range(8):
        batch["old_values"] = learner.compute_values(batch)
        losses.append(learner.update(batch).loss)
    assert losses[-1] < 0.7 * losses[0]


def test_critic_needs_returns_and_a_single_label(tiny):
    learner = TorchCriticLearner(tiny.critic(0), algo=AlgoConfig(), optim_config=OPTIM)
    batch = tiny.batch(seed=5)
    with pytest.raises(ValueError, match=r"update needs Experience\.returns"):
        learner.update({k: v for k, v in batch.items() if k != "returns"})
    from transformers import AutoModelForTokenClassification

    two = AutoModelForTokenClassification.from_config(tiny.config(num_labels=2))
    with pytest.raises(ValueError, match="the critic model must have one output label, got 2"):
        TorchCriticLearner(two, algo=AlgoConfig(), optim_config=OPTIM).compute_values(batch)
