"""The torch policy learner against hand-written references: logprobs, one PPO update, accumulation,
token-budget packing, the non-finite guard, checkpoints, weight export, LoRA and gradient checkpointing."""

import math

import pytest
import torch
from yatt_algos.learner.checkpoint import load_checkpoint, save_checkpoint
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig

pytest.importorskip("transformers", reason="the tiny test models are HF models")

# eps 1e-6: the gradient of the key-projection bias is analytically zero (softmax ignores a per-query shift),
# so it is float noise of ~1e-10, which Adam's first step at eps 1e-8 would blow up to +-lr.
OPTIM = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=8, clip_grad_norm=1.0, weight_decay=0.01)


def _hand_logprobs(model, batch):
    """log_softmax gather written out: position t holds log p(ids[t] | ids[:t]), 0 at t = 0 and at padding."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    out = torch.cat([torch.zeros(picked.shape[0], 1), picked], dim=1)
    return out * batch["attention_mask"]


@pytest.fixture(scope="module")
def policy_batch(tiny):
    """The shared batch with old logprobs near the model's own (ratios near 1, some clipped)."""
    batch = tiny.batch(seed=1)
    with torch.no_grad():
        lp = _hand_logprobs(tiny.lm(0), batch)
    g = torch.Generator().manual_seed(2)
    batch["old_logprobs"] = torch.where(
        batch["response_mask"], lp + 0.2 * torch.randn(lp.shape, generator=g), 0.0
    )
    return batch


def test_compute_logprobs_matches_log_softmax_gather(tiny, policy_batch):
    model = tiny.lm(0)
    with torch.no_grad():
        want = _hand_logprobs(model, policy_batch)
        probs = torch.softmax(model(input_ids=policy_batch["input_ids"]).logits[:, :-1], -1)
        want_ent = (
            torch.cat([torch.zeros(8, 1), -(probs * probs.log()).sum(-1)], 1) * policy_batch["attention_mask"]
        )
    for learner_cfg in (LearnerConfig(), LearnerConfig(max_tokens_per_micro_batch=48, logits_chunk_size=7)):
        learner = TorchPolicyLearner(model, algo=AlgoConfig(), optim_config=None, learner=learner_cfg)
        got = learner.compute_logprobs(policy_batch)
        assert got.shape == (8, 24) and torch.allclose(got, want, atol=1e-5, rtol=0)
        lp, ent = learner.compute_logprobs_and_entropy(policy_batch)
        assert torch.equal(lp, got) and torch.allclose(ent, want_ent, atol=1e-5, rtol=0)


def test_experience_messages_work_like_dicts(tiny, policy_batch):
    """An `Experience` (zero-copy tensors, as it crosses process boundaries) gives the same results."""
    import msgspec
    from yatt_algos import tensor_codec
    from yatt_algos.types import Experience

    fields = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "advantages", "ref_logprobs")
    exp = Experience(**{k: tensor_codec.encode(policy_batch[k]) for k in fields}, policy_version=3)
    exp = msgspec.msgpack.decode(msgspec.msgpack.encode(exp), type=Experience)
    learners = [TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(), optim_config=OPTIM) for _ in range(2)]
    assert torch.equal(learners[0].compute_logprobs(exp), learners[1].compute_logprobs(policy_batch))
    assert learners[0].update(exp).loss == learners[1].update({k: policy_batch[k] for k in fields}).loss
    assert tiny.diff(tiny.params(learners[0].model), tiny.params(learners[1].model)) == 0.0


def test_one_update_matches_hand_written_ppo_step(tiny, policy_batch):
    """PPO-clip + k3 KL loss, token-mean, clip-grad 1.0, AdamW: written out by hand on the whole batch."""
    b = policy_batch
    algo = AlgoConfig(kl_loss_coef=0.1)
    ref_model = tiny.lm(0)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    lp = _hand_logprobs(ref_model, b)
    mask = b["response_mask"].float()
    ratio = torch.exp(lp - b["old_logprobs"])
    pg = torch.maximum(-b["advantages"] * ratio, -b["advantages"] * ratio.clamp(0.8, 1.2))
    x = b["ref_logprobs"] - lp  # k3 = e^x - x - 1
    kl = torch.exp(x) - x - 1
    loss = ((pg + 0.1 * kl) * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0))
    opt.step()

    learner = TorchPolicyLearner(
        tiny.lm(0), algo=algo, optim_config=OptimConfig(**{**_fields(OPTIM), "micro_batch_size": 3})
    )
    stats = learner.update(b)
    assert tiny.diff(tiny.params(learner.model), tiny.params(ref_model)) < 1e-5
    assert stats.loss == pytest.approx(loss.item(), abs=1e-6)
    assert stats.grad_norm == pytest.approx(grad_norm, rel=1e-5)
    assert (stats.step, stats.num_skipped_steps, stats.num_tokens, stats.lr) == (1, 0, int(mask.sum()), 1e-3)
    assert 0.0 < stats.metrics["clip_frac"] < 1.0
    assert stats.metrics["ratio_max"] == pytest.approx(float(ratio[b["response_mask"]].max()), rel=1e-5)


def _fields(cfg):
    import msgspec

    return msgspec.structs.asdict(cfg)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_accumulation_and_packing_equal_one_batch(tiny, policy_batch, mode):
    algo = AlgoConfig(loss_agg_mode=mode, entropy_coef=0.01)
    results = []
    for micro, budget in ((8, 0), (3, 0), (8, 40)):
        cfg = OptimConfig(**{**_fields(OPTIM), "micro_batch_size": micro})
        learner = TorchPolicyLearner(
            tiny.lm(0), algo=algo, optim_config=cfg, learner=LearnerConfig(max_tokens_per_micro_batch=budget)
        )
        stats = learner.update(policy_batch)
        results.append((tiny.params(learner.model), stats.loss, stats.grad_norm))
    for params, loss, norm in results[1:]:
        assert tiny.diff(params, results[0][0]) < 1e-5
        assert loss == pytest.approx(results[0][1], abs=1e-6) and norm == pytest.approx(
            results[0][2], rel=1e-5
        )


def test_mini_batches_and_epochs_take_that_many_steps(tiny, policy_batch):
    algo = AlgoConfig(num_updates_per_batch=2)
    cfg = OptimConfig(
        **{**_fields(OPTIM), "mini_batch_size": 4, "micro_batch_size": 2, "num_warmup_steps": 10}
    )
    learner = TorchPolicyLearner(tiny.lm(0), algo=algo, optim_config=cfg)
    stats = learner.update(policy_batch)
    # 2 epochs x 2 mini-batches = 4 steps; the lr reported is the first step's: warmup 1/10 of 1e-3
    assert stats.step == 4 and stats.lr == pytest.approx(1e-4)
    assert learner.engine.scheduler.get_last_lr()[0] == pytest.approx(5e-4)


def test_nan_in_one_micro_batch_skips_the_step(tiny, policy_batch):
    cfg = OptimConfig(**{**_fields(OPTIM), "micro_batch_size": 2})
    learner = TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(), optim_config=cfg)
    learner.update(policy_batch)  # a first step, so Adam has moments to protect
    before = learner.state_dict()
    bad = dict(policy_batch)
    bad["advantages"] = policy_batch["advantages"].clone()
    row = int(policy_batch["response_mask"][4].nonzero()[0])
    bad["advantages"][4, row] = float("nan")  # micro-batch 3 of 4
    stats = learner.update(bad)
    after = learner.state_dict()
    assert stats.num_skipped_steps == 1 and stats.step == 1 and math.isnan(stats.grad_norm)
    assert stats.metrics["skipped_steps_total"] == 1.0
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    for pid, st in before["optimizer"]["state"].items():
        assert all(torch.equal(v, after["optimizer"]["state"][pid][k]) for k, v in st.items())
    assert before["scheduler"] == after["scheduler"]
    assert learner.update(policy_batch).num_skipped_steps == 0  # and training goes on


def test_checkpoint_round_trip_and_resume_match_uninterrupted(tiny, policy_batch, tmp_path):
    """Dropout on, so the resumed run matches only if the RNG state came back too."""
    algo, cfg = AlgoConfig(), OptimConfig(**{**_fields(OPTIM), "micro_batch_size": 4, "num_warmup_steps": 2})

    def learner():
        return TorchPolicyLearner(tiny.lm(0, attention_dropout=0.3), algo=algo, optim_config=cfg)

    straight = learner()
    torch.manual_seed(123)
    straight.update(policy_batch)
    save_checkpoint(straight.state_dict(), tmp_path / "step1.pt")
    straight.update(policy_batch)
    straight.update(policy_batch)

    resumed = TorchPolicyLearner(tiny.lm(7, attention_dropout=0.3), algo=algo, optim_config=cfg)
    torch.manual_seed(999)  # a different RNG position: the checkpoint must restore it
    resumed.load_state_dict(load_checkpoint(tmp_path / "step1.pt"))
    saved, reloaded = load_checkpoint(tmp_path / "step1.pt"), resumed.state_dict()
    assert all(torch.equal(saved["model"][k], reloaded["model"][k]) for k in saved["model"])
    assert saved["scheduler"] == reloaded["scheduler"] and torch.equal(
        saved["rng"]["torch"], reloaded["rng"]["torch"]
    )
    resumed.update(policy_batch)
    s = resumed.update(policy_batch)
    assert s.step == 3
    assert tiny.diff(tiny.params(resumed.model), tiny.params(straight.model)) == 0.0


def test_export_weights_in_hf_naming(tiny, policy_batch):
    learner = TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(), optim_config=OPTIM)
    learner.update(policy_batch)
    buckets = list(learner.export_weights(bucket_bytes=64 * 1024))
    exported = dict(pair for bucket in buckets for pair in bucket)
    hf = learner.model.state_dict()
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 64 * 1024 or len(bucket) == 1


def test_lora_trains_adapters_and_exports_merged_weights(tiny, policy_batch):
    pytest.importorskip("peft", reason="LoRA goes through peft")
    cfg = LearnerConfig(lora_rank=4, lora_alpha=8.0)
    learner = TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(), optim_config=OPTIM, learner=cfg)
    base_before = {k: v for k, v in tiny.params(learner.model).items() if "lora_" not in k}
    learner.update(policy_batch)
    learner.update(policy_batch)
    after = tiny.params(learner.model)
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # base frozen
    exported = {k: v for bucket in learner.export_weights(1 << 20) for k, v in bucket}
    plain = tiny.lm(0).state_dict()
    assert exported.keys() == plain.keys()
    # the merged q_proj differs from the base by scale * B @ A, scale = alpha / r = 2
    name = "model.layers.0.self_attn.q_proj.weight"
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    delta = 2.0 * after[f"{prefix}.lora_B.default.weight"] @ after[f"{prefix}.lora_A.default.weight"]
    assert float(delta.abs().max()) > 0
    assert torch.allclose(exported[name], plain[name] + delta, atol=1e-7)
    merged = learner.model.merge_and_unload()  # peft's own merge agrees
    assert torch.allclose(merged.state_dict()[name], exported[name], atol=1e-7)


def test_gradient_checkpointing_changes_nothing(tiny, policy_batch):
    out = []
    for gc in (False, True):
        learner = TorchPolicyLearner(
            tiny.lm(0),
            algo=AlgoConfig(),
            optim_config=OPTIM,
            learner=LearnerConfig(gradient_checkpointing=gc),
        )
        learner.update(policy_batch)
        out.append(tiny.params(learner.model))
    assert tiny.diff(out[0], out[1]) < 1e-5


def test_learners_satisfy_the_interface(tiny):
    from yatt_algos.learner.interface import CriticLearner, PolicyLearner
    from yatt_algos.learner.torch_backend import TorchCriticLearner

    assert isinstance(TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(), optim_config=None), PolicyLearner)
    critic = TorchCriticLearner(tiny.critic(0), algo=AlgoConfig(), optim_config=OPTIM)
    assert isinstance(critic, CriticLearner) and not isinstance(critic, PolicyLearner)


def test_bad_input_is_named(tiny, policy_batch):
    ref = TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(), optim_config=None)
    with pytest.raises(ValueError, match="this learner has no optimizer"):
        ref.update(policy_batch)
    learner = TorchPolicyLearner(tiny.lm(0), algo=AlgoConfig(kl_loss_coef=0.1), optim_config=OPTIM)
    with pytest.raises(ValueError, match=r"update needs Experience\.old_logprobs"):
        learner.update({k: v for k, v in policy_batch.items() if k != "old_logprobs"})
    with pytest.raises(ValueError, match=r"kl_loss_coef > 0 needs Experience\.ref_logprobs"):
        learner.update({k: v for k, v in policy_batch.items() if k != "ref_logprobs"})
    with pytest.raises(ValueError, match=r"AlgoConfig\.policy_loss 'nope' is not one of"):
        AlgoConfig(policy_loss="nope")  # refused where the config is built, before any learner
