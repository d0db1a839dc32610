"""One rank of the two-process Megatron test, run as a script by test_learner_megatron.py, inside the
test-only CPU shim (conftest.megatron_cpu_shim):

    python megatron_worker.py RANK PORT OUT_DIR LAYOUT [LAYOUT ...]    (LAYOUT: TPxPP, e.g. 2x1)

World size 2, every layout in turn on one gloo group (one process pair for all: imports are the cost; Megatron's
parallel state is made and destroyed per layout). TP = 2 or PP = 2 gives one data-parallel rank (both ranks
pass the whole batch), TP = PP = 1 gives two (each takes half of the batch). After one update rank 0 writes
the logprobs and stats, and every rank writes the HF weights its export yielded (each must be the whole
model: at PP = 2 both stages' layers), under OUT_DIR/LAYOUT.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def run_layout(tiny, rank: int, tp: int, pp: int, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    algo = AlgoConfig(kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean")
    optim = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)
    batch = tiny.dp_batch()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per = batch["input_ids"].shape[0] // dp
    shard = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in batch.items()}
    learner = MegatronPolicyLearner(
        tiny.tiny_config(), tiny.tiny_lm(0).state_dict(), algo=algo, optim_config=optim
    )
    logprobs = learner.compute_logprobs(shard)
    stats = learner.update(shard)
    weights = {k: v.clone() for bucket in learner.export_weights(1 << 16) for k, v in bucket}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out / f"weights{rank}.pt")
    parts = [None, None]
    dist.all_gather_object(parts, logprobs)
    if rank == 0:
        full = torch.cat(parts) if dp == 2 else parts[0]
        torch.save({"logprobs": full, "loss": stats.loss, "grad_norm": stats.grad_norm}, out / "rank0.pt")
    dist.barrier()
    ps.destroy_model_parallel()


def start(rank: int, port: int):
    """One thread of torch, the gloo group of the pair on 127.0.0.1, and the learner tests' conftest (tiny
    models, the CPU shim) loaded as a module, which it returns (the Megatron workers' common start)."""
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("learner_conftest", Path(__file__).with_name("conftest.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return tiny


def main() -> None:
    rank, port, out, layouts = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    tiny = start(rank, port)
    with tiny.megatron_cpu_shim():
        for layout in layouts:
            tp, pp = (int(n) for n in layout.split("x"))
            run_layout(tiny, rank, tp, pp, out / layout)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
