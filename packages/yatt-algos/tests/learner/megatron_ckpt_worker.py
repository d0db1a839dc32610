"""One rank of the Megatron sharded-checkpoint test, run as a script by test_learner_megatron.py, inside the
test-only CPU shim (conftest.megatron_cpu_shim):

    python megatron_ckpt_worker.py RANK PORT OUT_DIR

World size 2, at TP = 2 and then at PP = 2 (one process pair for both: imports are the cost): one update on
the whole batch, a sharded save (`save_shards`: `megatron_sharded`), a learner of other weights at the same
layout loads it (round trip), then the next update. The parallel state is then rebuilt at TP = PP = 1 (two
data parallel ranks, each with the whole model) and a learner of other weights loads the checkpoint and makes
that next update too. Rank 0 writes OUT_DIR/result-TPxPP.pt: the HF weights exported at the save, after the
round trip and after the load, the next update's loss and weights both ways, and the files each rank wrote.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _weights(learner) -> dict:
    return {k: v.clone() for bucket in learner.export_weights(1 << 16) for k, v in bucket}


def run_layout(tiny, tp: int, pp: int, out: Path) -> None:
    """The save at TP x PP, its round trip, and the load at TP = PP = 1; rank 0 writes OUT/result-TPxPP.pt."""
    from megatron.core import parallel_state as ps
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    algo = AlgoConfig(kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean")
    optim = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)
    batch, folder = tiny.dp_batch(), out / f"ckpt-{tp}x{pp}"

    def build(seed: int):
        return MegatronPolicyLearner(
            tiny.tiny_config(), tiny.tiny_lm(seed).state_dict(), algo=algo, optim_config=optim
        )

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    learner = build(0)
    learner.update(batch)
    learner.save_shards(str(folder))
    files = learner.wait_shards()
    saved = _weights(learner)
    same = build(7)  # the same layout, other weights: a round trip
    same.load_shards(str(folder))
    round_trip = _weights(same)
    loss = learner.update(batch).loss
    after = _weights(learner)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    resumed = build(7)
    resumed.load_shards(str(folder))
    loaded = _weights(resumed)
    resumed_loss = resumed.update(batch).loss
    resumed_after = _weights(resumed)
    ps.destroy_model_parallel()
    every = [None, None]
    dist.all_gather_object(every, files)
    if dist.get_rank() == 0:
        torch.save(
            {
                "saved": saved,
                "loaded": loaded,
                "round_trip": round_trip,
                "loss": loss,
                "resumed_loss": resumed_loss,
                "after": after,
                "resumed_after": resumed_after,
                "files": [{name: size for name, (_, size) in f.items()} for f in every],
                "steps": (resumed.num_steps, learner.num_steps),
            },
            out / f"result-{tp}x{pp}.pt",
        )
    dist.barrier()


def main() -> None:
    from megatron_worker import start  # the script's folder is on sys.path

    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    tiny = start(rank, port)
    with tiny.megatron_cpu_shim():
        for tp, pp in ((2, 1), (1, 2)):
            run_layout(tiny, tp, pp, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
