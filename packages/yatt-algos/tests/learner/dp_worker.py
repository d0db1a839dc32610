"""One rank of the data-parallel learner test, run as a script by test_learner_dp.py:

    python dp_worker.py RANK WORLD PORT {ddp,fsdp2} OUT_DIR

It joins a gloo group on 127.0.0.1, builds the same tiny model and batch as the test, takes its contiguous
shard of the batch, runs one update and writes (rank 0) the exported HF weights, stats and logprobs; then
checks that a learner resumed from its state_dict continues exactly like it.
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


def main() -> None:
    rank, world, port, backend, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        Path(sys.argv[5]),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import LearnerConfig

    tiny = _helpers()
    batch = tiny.dp_batch()
    per = batch["input_ids"].shape[0] // world
    shard = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    learner = TorchPolicyLearner(
        tiny.tiny_lm(0),
        algo=tiny.DP_ALGO,
        optim_config=tiny.DP_OPTIM,
        learner=LearnerConfig(data_parallel=backend, max_tokens_per_micro_batch=40),
        group=dist.group.WORLD,
    )
    stats = learner.update(shard)
    logprobs = learner.compute_logprobs(shard)
    weights = {k: v.clone() for bucket in learner.export_weights(1 << 16) for k, v in bucket}
    state = learner.state_dict()  # a collective under FSDP2
    # resume: a learner from other initial weights loads the state; one more update on each must agree exactly
    resumed = TorchPolicyLearner(
        tiny.tiny_lm(7),
        algo=tiny.DP_ALGO,
        optim_config=tiny.DP_OPTIM,
        learner=LearnerConfig(data_parallel=backend, max_tokens_per_micro_batch=40),
        group=dist.group.WORLD,
    )
    resumed.load_state_dict(state)
    learner.update(shard)
    resumed.update(shard)
    after = dict(pair for bucket in learner.export_weights(1 << 16) for pair in bucket)
    again = dict(pair for bucket in resumed.export_weights(1 << 16) for pair in bucket)
    resume_diff = max(float((after[k] - again[k]).abs().max()) for k in after)
    gathered = [None] * world
    dist.all_gather_object(gathered, logprobs)
    if rank == 0:
        result = {
            "weights": weights,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "num_tokens": stats.num_tokens,
            "logprobs": torch.cat(gathered),
            "state_keys": sorted(state["model"]),
            "resume_diff": resume_diff,
        }
        torch.save(result, out / "rank0.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
