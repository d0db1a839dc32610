"""YATT's losses in your own loop: a plain torch training loop (no YATT learner, no Ray) that takes
yatt-algos' advantage estimator, policy loss and `aggregate` and nothing else.

The loop trains a tiny Qwen2 (built from a config, never downloaded) on a fixed batch of 4 prompts x 2
samples with uneven response lengths: GRPO advantages, PPO-clip, token-mean aggregation, two SGD updates per
batch (the second one off-policy, so the clip is live). It runs twice:

- one process on the whole batch;
- two processes (torch.distributed, gloo), each holding two whole groups (GRPO's baseline is per group, so
  each rank computes its own advantages), each calling `aggregate(..., num_tokens=, num_seqs=)` with the
  *global* counts and all-reducing (summing) its gradients.

The package's promise is that the two give the same update: the final weights agree to 1e-6. The same two
processes then repeat the run with each rank's own counts and averaged gradients (what a plain DDP loop does):
with uneven ranks that is a different update, printed beside it.

    uv run python examples/losses_in_your_loop.py

The last printed line is one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from yatt_algos.types import AlgoConfig

VOCAB, SEQ_LEN, PROMPT_LEN = 64, 12, 4
NUM_GROUPS, GROUP_SIZE = 4, 2
LR, UPDATES_PER_BATCH = 0.5, 2
CFG = AlgoConfig(
    adv_estimator="grpo", policy_loss="ppo_clip", loss_agg_mode="token-mean", clip_ratio_high=0.28
)
WORLD = 2


def make_batch(seed: int = 0) -> dict:
    """Prompt + response token ids [B, T], right-padded; `mask` [B, T-1] marks response labels (aligned to
    logits[:, :-1], which predict input_ids[:, 1:]); one score per sample; a group id per prompt."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = NUM_GROUPS * GROUP_SIZE
    input_ids = torch.randint(0, VOCAB, (rows, SEQ_LEN), generator=g)
    response_len = torch.randint(1, SEQ_LEN - PROMPT_LEN + 1, (rows,), generator=g)
    positions = torch.arange(SEQ_LEN)
    attention = (positions < PROMPT_LEN + response_len[:, None]).long()
    labels = positions[1:]
    mask = (labels >= PROMPT_LEN) & (labels < PROMPT_LEN + response_len[:, None])
    return {
        "input_ids": input_ids * attention,  # 0 is the pad id
        "attention_mask": attention,
        "mask": mask.long(),
        "scores": torch.rand(rows, generator=g).round(decimals=1),
        "group_ids": torch.arange(NUM_GROUPS).repeat_interleave(GROUP_SIZE),
    }


def shard(batch: dict, rank: int, world: int) -> dict:
    """Rank r's whole groups: groups [r * G/world, (r+1) * G/world)."""
    per_rank = NUM_GROUPS // world
    keep = (batch["group_ids"] // per_rank) == rank
    return {k: v[keep] for k, v in batch.items()}


def logprobs(model, batch: dict):
    from yatt_algos.value import logprobs_from_logits

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])


def train(model, batch: dict, *, counts: dict | None, reduce_grads=None) -> list[float]:
    """Your loop: advantages, then UPDATES_PER_BATCH SGD steps on YATT's policy loss. `counts` are the
    global `num_tokens`/`num_seqs` (None: this batch's own); `reduce_grads` runs after each backward.
    Returns the loss of each update."""
    import torch
    from yatt_algos.advantages import ADVANTAGE_ESTIMATORS
    from yatt_algos.aggregation import aggregate
    from yatt_algos.policy_losses import POLICY_LOSSES

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    mask = batch["mask"]
    with torch.no_grad():
        old = logprobs(model, batch)
    advantages, _ = ADVANTAGE_ESTIMATORS[CFG.adv_estimator](
        batch["scores"], mask, CFG, group_ids=batch["group_ids"]
    )
    losses = []
    for _ in range(UPDATES_PER_BATCH):
        optimizer.zero_grad()
        per_token, _metrics = POLICY_LOSSES[CFG.policy_loss](
            logprobs(model, batch), old, advantages, mask, CFG
        )
        loss = aggregate(per_token, mask, CFG.loss_agg_mode, **(counts or {}))
        loss.backward()
        if reduce_grads is not None:
            reduce_grads(model)
        optimizer.step()
        losses.append(loss.item())
    return losses


def new_model():
    from yatt_rollout.tiny import tiny_causal_lm

    return tiny_causal_lm(VOCAB, seed=0).train()


def flat_params(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def global_counts(batch: dict) -> dict:
    """The whole batch's counts: in a real job, all-reduce each rank's counts once per batch."""
    mask = batch["mask"]
    return {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum())}


def worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """One rank: the same loop on its shard, twice (global counts + summed gradients; own counts + mean)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # a file, not a port: no rendezvous race
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        batch = make_batch()
        part = shard(batch, rank, world)

        def summed(model) -> None:
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

        def averaged(model) -> None:
            summed(model)
            for p in model.parameters():
                p.grad /= world

        results = {"tokens": int(part["mask"].sum())}
        for name, counts, reduce_grads in [
            ("global", global_counts(batch), summed),
            ("local", None, averaged),
        ]:
            model = new_model()
            losses = torch.tensor(train(model, part, counts=counts, reduce_grads=reduce_grads))
            dist.all_reduce(losses, op=dist.ReduceOp.SUM)  # each rank's loss is its share of the total
            results[name] = {
                "params": flat_params(model),
                "losses": (losses / (world if counts is None else 1)),
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    import torch
    import torch.multiprocessing as mp

    del argv  # no options
    torch.manual_seed(0)
    batch = make_batch()
    single = new_model()
    single_losses = train(single, batch, counts=None)
    reference = flat_params(single)

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(WORLD, str(Path(tmp) / "store"), tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]

    def max_diff(a, b) -> float:
        return float((a - b).abs().max())

    result = {
        "tokens_per_rank": [r["tokens"] for r in ranks],
        "single_losses": single_losses,
        "two_process_losses": ranks[0]["global"]["losses"].tolist(),
        "max_param_diff": max_diff(ranks[0]["global"]["params"], reference),
        "ranks_param_diff": max_diff(ranks[0]["global"]["params"], ranks[1]["global"]["params"]),
        "max_param_diff_local_counts": max_diff(ranks[0]["local"]["params"], reference),
        "param_change": max_diff(reference, flat_params(new_model())),
    }
    print(f"response tokens per rank: {result['tokens_per_rank']} (of {int(batch['mask'].sum())})")
    print(f"losses, one process:   {[round(x, 6) for x in result['single_losses']]}")
    print(f"losses, two processes: {[round(x, 6) for x in result['two_process_losses']]}")
    print(f"max |weight difference| two vs one process, global counts: {result['max_param_diff']:.2e}")
    print(
        f"  the same with each rank's own counts (plain DDP mean):  {result['max_param_diff_local_counts']:.2e}"
    )
    print(f"  (the update itself moved weights by up to {result['param_change']:.2e})")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
