"""One learner rank of test_weight_sync_stream.py, run as a script (2 gloo ranks on the CPU):

    python stream_sync_worker.py RANK WORLD PORT OUT_DIR

An FSDP2 policy learner (tiny Qwen2) and, in the same process, an HF rollout engine of another initialization:
the colocated layout, where each rank's engine loads from that rank. Both ranks train one step, then stream
the weight sync as `phases.sync_weights` drives it: every rank gathers bucket i (`LearnerWeights.next_bucket`)
and the push (`weight_sync.copy_local`, the runtime's in-process copy) loads it into the engine before bucket
i + 1 is gathered. Every tensor the export hands out is watched by a weak reference, so the bytes still alive
anywhere in the process (held by the worker, the sync or the engine) are counted at each load. Then the whole
model is gathered at once (`gather_all`, the async path) and counted the same way. Rank R writes
OUT_DIR/rank-R.pt.
"""

import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

BUCKET_BYTES = 1 << 16  # 64 KiB: the tiny model's ~0.4 MiB travels in several buckets


def _model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


class Watched:
    """The learner's export, every tensor it yields recorded by a weak reference with its bytes."""

    def __init__(self, learner) -> None:
        self.learner, self.refs = learner, []

    def export_weights(self, bucket_bytes: int):
        for bucket in self.learner.export_weights(bucket_bytes):
            for _, tensor in bucket:
                self.refs.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
            yield bucket
            del bucket  # as a generator frame would: nothing here keeps it past the next request

    def alive_bytes(self) -> int:
        return sum(size for ref, size in self.refs if ref() is not None)


class Receiver:
    """The engine's side of the in-process copy, counting the exported bytes alive at each load."""

    def __init__(self, engine, watched: Watched) -> None:
        self.engine, self.watched, self.alive, self.loads = engine, watched, [], 0

    def load_weights(self, named, version: int) -> None:
        self.alive.append(self.watched.alive_bytes())
        self.loads += 1
        self.engine.load_weights(named, version)


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig
    from yatt_apps.runtime.learner_weights import LearnerWeights
    from yatt_controller.weight_sync import copy_local
    from yatt_rollout.hf_engine import HFEngine

    learner = TorchPolicyLearner(
        _model(0),
        algo=AlgoConfig(),
        optim_config=OptimConfig(lr=1e-2, micro_batch_size=2),
        learner=LearnerConfig(data_parallel="fsdp2"),
        group=dist.group.WORLD,
    )
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(1, 128, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.bool)
    learner.update(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "response_mask": mask,
            "old_logprobs": torch.full((2, 12), -5.0),
            "advantages": torch.tensor([[1.0], [-1.0]]).expand(2, 12),
        }
    )
    watched = Watched(learner)
    weights = LearnerWeights(watched, "fsdp2")
    engine = HFEngine(_model(1), seed=0)
    receiver = Receiver(engine, watched)
    buckets, gathered = 0, []
    while (held := weights.next_bucket(BUCKET_BYTES)) > 0:  # every rank together, as the driver's loop
        gathered.append(held)
        copy_local(weights, receiver, version=1)
        dist.barrier()  # the driver's barrier: no rank frees bucket i while another still pushes it
        buckets += 1
    stream_alive = list(receiver.alive)
    streamed = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    weights.gather_all()  # the reference: the whole model at once, counted the same way
    full = dict(weights.named_weights())
    receiver.alive.clear()
    copy_local(weights, receiver, version=2)
    result = {
        "buckets": buckets,
        "bucket_bytes": gathered,
        "stream_alive": stream_alive,
        "gather_all_alive": list(receiver.alive),
        "model_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in full.values()),
        "peak_bytes": weights.peak_bytes,
        "engine_diff": max(float((streamed[k] - v).abs().max()) for k, v in full.items()),
        "names_equal": sorted(streamed) == sorted(full),
    }
    torch.save(result, out / f"rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
