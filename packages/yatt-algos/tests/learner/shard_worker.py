"""One rank of the sharded-checkpoint tests, run as a script by test_learner_sharded.py:

    python shard_worker.py RANK WORLD PORT OUT_DIR

Both ranks train the tiny model one step on their half of batch A, save a sharded (DCP) checkpoint in the
background and train on batch B while it is written. Then, from that checkpoint: a fresh learner of the same
world size (round trip), rank 0 alone at world size 1 (2 -> 1), and a streaming read of the model (export);
and from a checkpoint rank 0 writes alone after batch A, both ranks at world size 2 (1 -> 2). Rank 0 writes
the numbers to OUT_DIR/rank0.pt; every rank its files to OUT_DIR/files-RANK.pt (FSDP2) and ddp-files-RANK.pt
(the same first step under DDP, saved synchronously).
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _helpers():
    spec = importlib.util.spec_from_file_location("learner_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _learner(tiny, seed: int, backend: str, group):
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import LearnerConfig

    cfg = LearnerConfig(data_parallel=backend, max_tokens_per_micro_batch=40)
    return TorchPolicyLearner(
        tiny.tiny_lm(seed), algo=tiny.DP_ALGO, optim_config=tiny.DP_OPTIM, learner=cfg, group=group
    )


def _weights(learner) -> dict:
    return {k: v.clone() for bucket in learner.export_weights(1 << 16) for k, v in bucket}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    backend = "fsdp2"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from yatt_algos.learner.sharded import iter_checkpoint_tensors

    tiny = _helpers()
    batch_a, batch_b = tiny.dp_batch(), tiny.make_batch(seed=5)
    per = batch_a["input_ids"].shape[0] // world

    def shard(batch):
        return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}

    world_group = dist.group.WORLD
    learner = _learner(tiny, 0, backend, world_group)
    learner.update(shard(batch_a))
    saved = _weights(learner)
    ck2 = out / "ck2"
    learner.save_shards(str(ck2), background=True)  # staged; written while batch B trains
    loss_b = learner.update(shard(batch_b)).loss
    files = learner.wait_shards()
    torch.save({name: size for name, (_, size) in files.items()}, out / f"files-{rank}.pt")
    result: dict = {"loss_b": loss_b}

    resumed = _learner(tiny, 7, backend, world_group)  # other initial weights
    resumed.load_shards(str(ck2))
    result["round_trip_diff"] = _diff(_weights(resumed), saved)
    result["round_trip_loss_b"] = resumed.update(shard(batch_b)).loss
    if rank == 0:
        alone = _learner(tiny, 7, backend, None)
        alone.load_shards(str(ck2))
        result["two_to_one_loss_b"] = alone.update(batch_b).loss
        streamed = dict(
            pair for bucket in iter_checkpoint_tensors(ck2, bucket_bytes=1 << 16) for pair in bucket
        )
        result["export_diff"] = _diff(streamed, saved)
        result["export_buckets"] = sum(1 for _ in iter_checkpoint_tensors(ck2, bucket_bytes=1 << 16))
        single = _learner(tiny, 0, backend, None)
        single.update(batch_a)
        single.save_shards(str(out / "ck1"))
        single.wait_shards()
    dist.barrier()
    grown = _learner(tiny, 7, backend, world_group)
    grown.load_shards(str(out / "ck1"))
    result["one_to_two_loss_b"] = grown.update(shard(batch_b)).loss
    ddp = _learner(tiny, 0, "ddp", world_group)
    ddp.update(shard(batch_a))
    ddp.save_shards(str(out / "ck-ddp"))
    ddp_files = ddp.wait_shards()
    torch.save({name: size for name, (_, size) in ddp_files.items()}, out / f"ddp-files-{rank}.pt")
    if rank == 0:
        torch.save(result, out / "rank0.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
