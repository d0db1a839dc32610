"""One rank of the two-process Megatron test, run as a script by test_learner_megatron.py, inside the
test-only CPU shim (conftest.megatron_cpu_shim):

    python megatron_worker.py RANK PORT TP PP OUT_DIR

World size 2: TP = 2 or PP = 2 gives one data-parallel rank (both ranks pass the whole batch), TP = PP = 1
gives two (each takes half of the batch). After one update rank 0 writes the logprobs and stats, and every rank
writes the HF weights its export yielded (each must be the whole model: at PP = 2 both stages' layers).
"""

import importlib.util
import sys
from pathlib import Path

import torch


def main() -> None:
    (rank, port, tp, pp), out = (int(a) for a in sys.argv[1:5]), Path(sys.argv[5])
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("learner_conftest", Path(__file__).with_name("conftest.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    tiny.init_megatron(rank, 2, port, tp=tp, pp=pp)
    from megatron.core import parallel_state as ps
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    algo = AlgoConfig(kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean")
    optim = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)
    batch = tiny.dp_batch()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per = batch["input_ids"].shape[0] // dp
    shard = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in batch.items()}
    with tiny.megatron_cpu_shim():
        learner = MegatronPolicyLearner(
            tiny.tiny_config(), tiny.tiny_lm(0).state_dict(), algo=algo, optim_config=optim
        )
        logprobs = learner.compute_logprobs(shard)
        stats = learner.update(shard)
        weights = {k: v.clone() for bucket in learner.export_weights(1 << 16) for k, v in bucket}
    torch.save(weights, out / f"weights{rank}.pt")
    parts = [None, None]
    torch.distributed.all_gather_object(parts, logprobs)
    if rank == 0:
        full = torch.cat(parts) if dp == 2 else parts[0]
        torch.save(
            {"logprobs": full, "loss": stats.loss, "grad_norm": stats.grad_norm},
            out / "rank0.pt",
        )
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
