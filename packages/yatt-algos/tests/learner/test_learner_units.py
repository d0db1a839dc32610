"""Pure pieces of the learner: lr schedule, packing, buckets, metric reduction, checkpoint files."""

import math

import pytest
import torch
from yatt_algos.learner import checkpoint, export, optim, packing
from yatt_algos.learner.update_loop import MetricSums


def test_lr_warmup_then_cosine():
    kw = dict(num_warmup_steps=4, num_training_steps=12, min_lr_ratio=0.1)
    # warmup: (s + 1) / 4 -> 0.25, 0.5, 0.75, 1.0
    assert [optim.lr_ratio(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over 8 steps: s = 8 is halfway, 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55
    assert optim.lr_ratio(8, **kw) == pytest.approx(0.55)
    # s = 6: progress 2/8, 0.1 + 0.45 * (1 + cos(pi / 4)) = 0.1 + 0.45 * 1.70711 = 0.868198
    assert optim.lr_ratio(6, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert optim.lr_ratio(12, **kw) == pytest.approx(0.1)
    assert optim.lr_ratio(50, **kw) == pytest.approx(0.1)  # held at the floor
    assert optim.lr_ratio(0, num_warmup_steps=0, num_training_steps=10, min_lr_ratio=0.0) == 1.0


def test_scheduler_drives_adamw_lr():
    from yatt_algos.types import OptimConfig

    w = torch.nn.Parameter(torch.zeros(2))
    cfg = OptimConfig(lr=1e-3, num_warmup_steps=2, num_training_steps=4)
    opt = optim.build_optimizer([w], cfg)
    sched = optim.build_scheduler(opt, cfg)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        w.grad = torch.ones(2)
        optim.guarded_step([w], opt, sched, max_norm=1.0)
    # warmup 0.5e-3, 1e-3; cosine over 2 steps: 1e-3, 0.5e-3
    assert lrs == pytest.approx([0.5e-3, 1e-3, 1e-3, 0.5e-3])


def test_guarded_step_clips_and_skips_non_finite():
    from yatt_algos.types import OptimConfig

    w = torch.nn.Parameter(torch.zeros(2))
    opt = optim.build_optimizer([w], OptimConfig(lr=0.1))
    sched = optim.build_scheduler(opt, OptimConfig(lr=0.1))
    w.grad = torch.tensor([3.0, 4.0])
    norm, applied = optim.guarded_step([w], opt, sched, max_norm=1.0)
    # norm 5; clipped grad (0.6, 0.8); Adam's first step moves each weight by lr * sign = -0.1
    assert (norm, applied) == (5.0, True)
    assert torch.allclose(w.detach(), torch.tensor([-0.1, -0.1]), atol=1e-6)
    before = (w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()})
    w.grad = torch.tensor([float("nan"), 1.0])
    norm, applied = optim.guarded_step([w], opt, sched, max_norm=1.0)
    assert math.isnan(norm) and not applied and w.grad is None
    assert torch.equal(w.detach(), before[0])
    assert all(torch.equal(opt.state[w][k], v) for k, v in before[1].items())
    assert sched.last_epoch == 1


def test_pack_by_token_budget():
    lengths = [5, 20, 7, 18, 6, 3]
    # sorted longest first: 20, 18, 7, 6, 5, 3 (positions 1, 3, 2, 4, 0, 5); budget 40:
    # [20, 18] = 2 x 20 = 40 fits; + 7 would be 3 x 20 = 60. [7, 6, 5, 3] = 4 x 7 = 28 fits.
    assert packing.pack_micro_batches(lengths, micro_batch_size=2, max_tokens=40) == [[1, 3], [2, 4, 0, 5]]
    assert packing.pack_micro_batches(lengths, micro_batch_size=4, max_tokens=0) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(
        ValueError, match=r"a sequence of 20 tokens exceeds LearnerConfig\.max_tokens_per_micro_batch=19"
    ):
        packing.pack_micro_batches(lengths, micro_batch_size=2, max_tokens=19)


def test_split_and_trim():
    assert [r.tolist() for r in packing.split_mini_batches(6, 3)] == [[0, 1, 2], [3, 4, 5]]
    assert [r.tolist() for r in packing.split_mini_batches(6, 0)] == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match=r"batch size 6 is not a multiple of OptimConfig\.mini_batch_size 4"):
        packing.split_mini_batches(6, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    assert packing.seq_lengths(mask).tolist() == [2, 3, 0]
    batch = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask.bool()}
    ((rows, mb),) = packing.micro_batches(batch, torch.tensor([0, 1]), micro_batch_size=2, max_tokens=0)
    assert rows.tolist() == [0, 1] and mb["input_ids"].tolist() == [[0, 1, 2], [4, 5, 6]]


def test_as_batch_names_bad_fields():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="batch has no 'attention_mask'"):
        packing.as_batch({"input_ids": ids})
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 2\), expected \(2, 3\)"):
        packing.as_batch({"input_ids": ids, "attention_mask": ids.bool(), "advantages": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="input_ids must be an integer"):
        packing.as_batch({"input_ids": ids.float(), "attention_mask": ids.bool()})


def test_experience_decodes_to_batch():
    from yatt_algos import tensor_codec
    from yatt_algos.types import Experience

    ids = torch.tensor([[1, 2, 3]])
    exp = Experience(
        input_ids=tensor_codec.encode(ids),
        attention_mask=tensor_codec.encode(torch.ones(1, 3, dtype=torch.bool)),
        response_mask=tensor_codec.encode(torch.tensor([[False, True, True]])),
        old_logprobs=tensor_codec.encode(torch.tensor([[0.0, -1.0, -2.0]])),
        advantages=tensor_codec.encode(torch.tensor([[0.0, 1.0, 1.0]])),
    )
    batch = packing.as_batch(exp)
    assert set(batch) == {"input_ids", "attention_mask", "response_mask", "old_logprobs", "advantages"}
    assert batch["response_mask"].dtype == torch.bool and batch["old_logprobs"].tolist() == [
        [0.0, -1.0, -2.0]
    ]


def test_buckets_respect_budget_and_dtype():
    named = [
        ("a", torch.zeros(4)),
        ("b", torch.zeros(4)),
        ("c", torch.zeros(10)),
        ("d", torch.zeros(2, dtype=torch.bfloat16)),
    ]
    # 16 + 16 bytes fit 40; c (40 bytes) would make 72 -> alone; d changes dtype -> its own bucket
    buckets = list(export.iter_buckets(named, bucket_bytes=40))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in export.iter_buckets(named[:3], 8)] == [["a"], ["b"], ["c"]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        next(export.iter_buckets(named, 0))


def test_metric_sums_weighting():
    sums = MetricSums()
    sums.add(torch.tensor(0.5), {"clip_frac": torch.tensor(0.2), "ratio_max": torch.tensor(1.5)}, 10)
    sums.add(torch.tensor(0.25), {"clip_frac": torch.tensor(0.5), "ratio_max": torch.tensor(1.2)}, 30)
    out = sums.reduce(None)
    # clip_frac token-weighted: (0.2 * 10 + 0.5 * 30) / 40 = 0.425; loss shares summed: 0.75
    assert out == pytest.approx({"loss": 0.75, "clip_frac": 0.425, "ratio_max": 1.5})


def test_checkpoint_file_is_atomic_and_safe(tmp_path):
    state = {"w": torch.arange(3.0), "rng": checkpoint.rng_state(), "n": 3}
    expected = torch.rand(3)  # the draw that follows the captured state
    path = checkpoint.save_checkpoint(state, tmp_path / "ck" / "learner.pt")
    assert [p.name for p in path.parent.iterdir()] == ["learner.pt"]  # no temporary file left
    loaded = checkpoint.load_checkpoint(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3
    torch.rand(5)
    checkpoint.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match="rng state has no 'torch' entry"):
        checkpoint.set_rng_state({"python": state["rng"]["python"]})
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint.load_checkpoint(tmp_path / "missing.pt")


def test_mismatch_metrics_by_hand():
    from yatt_algos.learner.mismatch import mismatch_metrics

    train = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.5], [0.0, -0.5, 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    out = mismatch_metrics(train, rollout, mask)
    # x = train - rollout on the 3 tokens: 0.5, -0.5, 0 -> mean |x| = 1/3, max 0.5
    # k3 = e^x - 1 - x: 0.148721, 0.106531, 0 -> mean 0.085084
    assert out["mismatch_abs_mean"] == pytest.approx(1 / 3)
    assert out["mismatch_abs_max"] == pytest.approx(0.5)
    assert out["mismatch_k3"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 3)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(2, 2\), mask has \(2, 3\)"):
        mismatch_metrics(train, rollout[:, :2], mask)
