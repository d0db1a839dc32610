"""The GRPO step's skipped old-logprob forward: with one optimizer step per batch, `PolicyWorker.logprobs_and_train`
(reference forward + an update whose own forward gives the old logprobs) returns and updates exactly what the
separate `logprobs` then `train` calls do, on a fixed seed; the step takes that path only where it is exact."""

from types import SimpleNamespace

import msgspec
import pytest
import torch
from yatt_apps.config import ModelSpec, RunConfig
from yatt_apps.jobs.grpo import logprobs_and_train, old_logprobs_from_update, rollout_logprobs
from yatt_apps.runtime.workers import PolicyWorker

ONE_RANK = SimpleNamespace(dp_size=1, tp_size=1, dp_rank=0, tp_rank=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from yatt_apps.io.data import arithmetic_task
    from yatt_apps.io.models import prepare_model, tokenizer_corpus

    corpus = tokenizer_corpus(arithmetic_task(64, seed=0))
    return str(prepare_model(ModelSpec(), tmp_path_factory.mktemp("skip") / "policy", corpus))


def _cfg(**algo) -> RunConfig:
    base = RunConfig()
    return msgspec.structs.replace(
        base,
        algo=msgspec.structs.replace(
            base.algo, **({"kl_loss_coef": 1e-3, "num_updates_per_batch": 1} | algo)
        ),
        optim=msgspec.structs.replace(base.optim, lr=2e-3, micro_batch_size=4, mini_batch_size=0),
    )


def _experience(vocab: int) -> dict:
    """8 rows: a 5-token prompt, then 3..10 response tokens, right padded to 16; fixed-seed advantages."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(16)
    lengths = 5 + torch.tensor([3, 10, 7, 4, 9, 6, 8, 5])
    attention = pos[None] < lengths[:, None]
    response = attention & (pos[None] >= 5)
    adv = torch.randn(8, generator=g)[:, None].expand(-1, 16)
    return {
        "input_ids": torch.randint(1, vocab, (8, 16), generator=g) * attention,
        "attention_mask": attention,
        "response_mask": response,
        "advantages": torch.where(response, adv, 0.0),
        "rollout_logprobs": torch.where(response, -3.0, 0.0),
        "group_ids": torch.arange(8) // 4,
    }


def test_skipped_forward_gives_the_same_update(model_dir):
    torch.set_num_threads(1)
    cfg = _cfg()
    separate = PolicyWorker(cfg, model_dir, "unused", worker_info=ONE_RANK)
    fused = PolicyWorker(cfg, model_dir, "unused", worker_info=ONE_RANK)
    exp = _experience(fused.learner.model.config.vocab_size)
    lp = separate.logprobs(exp)
    want = separate.train({**exp, "old_logprobs": lp["old_logprobs"], "ref_logprobs": lp["ref_logprobs"]})
    got = fused.logprobs_and_train(exp)
    stats = got.pop("stats")
    assert sorted(got) == ["entropy", "old_logprobs", "ref_logprobs"]
    for key in got:
        assert torch.equal(got[key], lp[key]), key
    assert stats == want and stats["ratio_max"] == 1.0 and stats["kl_loss"] >= 0.0
    # the KL term is 0 at the first step (policy == reference) and the policy moved: both updated alike
    assert torch.equal(lp["old_logprobs"], lp["ref_logprobs"]) and stats["kl_loss"] == 0.0
    after = dict(fused.named_weights())
    for name, value in separate.named_weights():
        assert torch.equal(after[name], value), name
    moved = separate.logprobs(exp)["old_logprobs"]
    assert not torch.equal(moved, lp["old_logprobs"])


def test_step_takes_the_skip_only_where_exact():
    assert old_logprobs_from_update(_cfg())
    assert not old_logprobs_from_update(_cfg(num_updates_per_batch=2))
    mini = _cfg()
    mini = msgspec.structs.replace(mini, optim=msgspec.structs.replace(mini.optim, mini_batch_size=4))
    assert not old_logprobs_from_update(mini)


def test_rollout_logprobs_fill_the_response_tokens():
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    batch["response_mask"] = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    done = [SimpleNamespace(logprobs=[-0.5, -1.5]), SimpleNamespace(logprobs=[-1.0, -2.0, -3.0, -4.0])]
    want = torch.tensor([[0, 0, -0.5, -1.5, 0], [0, -1.0, -2.0, -3.0, -4.0]])
    assert torch.equal(rollout_logprobs(batch, done), want)


class TwoRankCtxDouble:
    """TEST DOUBLE of a step context: `shard_rows` gives row halves to two independent one-rank workers (no
    gradient all-reduce between them) and `get` returns their results, as the runtime's would arrive."""

    def __init__(self, workers) -> None:
        self.learner, self.workers = self, workers
        self.weight_sync = None  # no engines to push to

    def shard_rows(self, method: str, batch: dict) -> list:
        half = batch["input_ids"].shape[0] // 2
        parts = [{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]
        return [getattr(w, method)(part) for w, part in zip(self.workers, parts, strict=True)]

    def get(self, results: list) -> list:
        return results


def test_step_helper_joins_every_ranks_rows_in_order(model_dir):
    cfg = _cfg()
    workers = [PolicyWorker(cfg, model_dir, "unused", worker_info=ONE_RANK) for _ in range(2)]
    exp = _experience(workers[0].learner.model.config.vocab_size)
    separate = PolicyWorker(cfg, model_dir, "unused", worker_info=ONE_RANK)
    want = separate.logprobs(exp)  # the policy before any update: what both halves' old logprobs are
    lp, stats = logprobs_and_train(TwoRankCtxDouble(workers), exp)
    assert sorted(lp) == ["entropy", "old_logprobs", "ref_logprobs"]
    for key in lp:
        assert torch.equal(lp[key], want[key]), key
    assert stats["num_skipped_steps"] == 0.0 and stats["ratio_max"] == 1.0


def test_policy_worker_sizes_its_reference_and_threads_from_the_config(model_dir):
    """The reference forward runs at `optim.micro_batch_size` rows (it ran 4 at a time whatever the user set:
    a 64-row batch took 16 forwards) and the worker's torch threads are `placement.cpus_per_device`."""
    cfg = _cfg()
    cfg = msgspec.structs.replace(
        cfg,
        optim=msgspec.structs.replace(cfg.optim, micro_batch_size=8),
        placement=msgspec.structs.replace(cfg.placement, cpus_per_device=2.0),
    )
    try:
        worker = PolicyWorker(cfg, model_dir, "unused", worker_info=ONE_RANK)
        assert torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(1)
    rows = []
    worker.reference.model.register_forward_hook(lambda m, args, out: rows.append(1))
    worker.logprobs_and_train(_experience(worker.learner.model.config.vocab_size))
    assert worker.reference.micro_batch_size == 8 and rows == [1]  # 8 rows: one reference forward
