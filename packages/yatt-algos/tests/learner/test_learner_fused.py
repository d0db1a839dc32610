"""`update_from_current`: one optimizer step per batch with the training forward's detached logprobs as the old
ones (no separate no-grad forward) gives exactly what the separate forward + `update` gives."""

import msgspec
import pytest
import torch
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig

pytest.importorskip("transformers", reason="the tiny test models are HF models")

OPTIM = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=8, clip_grad_norm=1.0, weight_decay=0.01)


@pytest.fixture(scope="module")
def fresh_batch(tiny):
    """A batch as the step has it before logprobs: no old logprobs yet."""
    batch = tiny.batch(seed=1)
    return {k: v for k, v in batch.items() if k != "old_logprobs"}


@pytest.mark.parametrize(
    ("micro", "budget", "entropy_coef"),
    [(8, 0, 0.0), (3, 0, 0.01), (8, 40, 0.0)],
    ids=["whole", "micro3", "packed"],
)
def test_fused_update_equals_separate_old_forward(tiny, fresh_batch, micro, budget, entropy_coef):
    algo = AlgoConfig(kl_loss_coef=0.1, entropy_coef=entropy_coef)
    optim = msgspec.structs.replace(OPTIM, micro_batch_size=micro)
    learner_cfg = LearnerConfig(max_tokens_per_micro_batch=budget)

    def learner():
        return TorchPolicyLearner(tiny.lm(0), algo=algo, optim_config=optim, learner=learner_cfg)

    separate = learner()
    old, entropy = separate.compute_logprobs_and_entropy(fresh_batch)
    want = separate.update({**fresh_batch, "old_logprobs": old})
    fused = learner()
    got, seen = fused.update_from_current(fresh_batch)
    # the same values bit for bit: old logprobs, entropy, the update, the loss and every metric
    assert torch.equal(seen["old_logprobs"], old) and torch.equal(seen["entropy"], entropy)
    assert tiny.diff(tiny.params(fused.model), tiny.params(separate.model)) == 0.0
    assert (got.loss, got.grad_norm, got.step, got.num_tokens) == (
        want.loss,
        want.grad_norm,
        1,
        want.num_tokens,
    )
    assert got.metrics == want.metrics
    # ratio 1 everywhere: the policy-gradient term is minus the token-mean advantage
    mask = fresh_batch["response_mask"]
    assert got.metrics["ratio_max"] == 1.0 and got.metrics["clip_frac"] == 0.0
    pg = -float((fresh_batch["advantages"] * mask).sum() / mask.sum())
    assert got.metrics["pg_loss"] == pytest.approx(pg, abs=1e-6)


def test_fused_update_refuses_what_it_cannot_do_exactly(tiny, fresh_batch):
    def learner(algo=None, optim=OPTIM):
        return TorchPolicyLearner(tiny.lm(0), algo=algo or AlgoConfig(), optim_config=optim)

    with pytest.raises(ValueError, match=r"num_updates_per_batch=2 and 1 mini-batches"):
        learner(algo=AlgoConfig(num_updates_per_batch=2)).update_from_current(fresh_batch)
    with pytest.raises(ValueError, match=r"num_updates_per_batch=1 and 2 mini-batches"):
        learner(optim=msgspec.structs.replace(OPTIM, mini_batch_size=4)).update_from_current(fresh_batch)
    old = torch.zeros_like(fresh_batch["advantages"])
    with pytest.raises(ValueError, match="must not hold them"):
        learner().update_from_current({**fresh_batch, "old_logprobs": old})


def test_an_inference_learner_runs_at_the_micro_batch_size_it_is_given(tiny, fresh_batch):
    """A reference (optim_config=None) forwards `micro_batch_size` rows at a time (4 when unset): the job gives
    it the policy's size, so a reference forward no longer runs 8 rows as two forwards of 4."""

    def forwards(micro_batch_size):
        rows = []
        ref = TorchPolicyLearner(
            tiny.lm(0), algo=AlgoConfig(), optim_config=None, micro_batch_size=micro_batch_size
        )
        ref.model.register_forward_hook(
            lambda m, args, kw, out: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        return ref.compute_logprobs(fresh_batch), rows

    whole, whole_rows = forwards(8)
    default, default_rows = forwards(None)
    assert whole_rows == [8] and default_rows == [4, 4]
    torch.testing.assert_close(whole, default, rtol=0, atol=1e-6)
