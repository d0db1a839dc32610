"""Benchmark of sharded checkpoints (yatt_algos.learner.sharded): FSDP2 on 2 gloo ranks on the CPU, the "small"
Qwen2 policy built from a config (quick: hidden 768, 6 layers, vocabulary 32,000: 86 M parameters, 330 MiB in
fp32; full: hidden 1024, 12 layers), AdamW (so the full state is about 3x the model).

Each rank (its own process, one thread) trains one step, then:
1. saves synchronously (`save_shards` + `wait_shards`: DCP files written and hashed) and then in the background
   (`save_shards(background=True)`: the state staged in host memory; the step goes on while a thread writes),
   timing how long the step is blocked by each: `save_blocking_over_sync_save` = async / sync;
2. `bytes_per_rank_over_full`: the largest rank's files over the full (unsharded) model + optimizer state;
3. `peak_extra_mib_over_model_mib`: peak RSS (VmHWM, reset through /proc/self/clear_refs, after malloc_trim)
   over the RSS before, in MiB, over the full model's MiB, the worse rank (ranks run with
   MALLOC_MMAP_THRESHOLD_=1 MiB, so a freed tensor leaves the RSS instead of staying in glibc's heap): `.save` during the synchronous save,
   `.weight_sync` during the runtime's streamed weight sync (`yatt_apps.runtime.learner_weights.LearnerWeights`
   gathering 64 MiB buckets on every rank, each loaded by `yatt_controller.weight_sync.copy_local` into the
   rank's own HF rollout engine, the colocated push, before the next is gathered, as `phases.sync_weights`
   drives it), and the top-level key the larger of the two. Reported beside them, not targets:
   `.save_async_staging` (a background save holds a host copy of the rank's shard until written: the price
   of not blocking) and `.gather_all` (the whole model gathered, then one push: an async step's path);
4. `reshard_resume_ok`: rank 0 alone (world size 1, no process group) loads the background-saved checkpoint and
   trains the next batch: 1 when its loss equals the 2-rank run's loss on that batch (to 1e-4 relative).

The last printed line is one JSON object. `--quick` takes about a minute and a half on 2 cores and ~4 GiB.

    python benchmarks/bench_checkpoint.py --quick
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {"quick": (768, 6, 2048), "full": (1024, 12, 2816)}  # hidden, layers, intermediate


def _model(size: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, inter = SIZES[size]
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def _batch(seed: int, rows: int = 2, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32000, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.bool)
    response = mask.clone()
    response[:, :4] = False
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response,
        "old_logprobs": torch.full((rows, length), -10.0) * response,
        "advantages": torch.randn(rows, generator=g)[:, None].expand(-1, length) * response,
    }


def _learner(size: str, seed: int, group):
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig

    return TorchPolicyLearner(
        _model(size, seed),
        algo=AlgoConfig(),
        optim_config=OptimConfig(lr=1e-4, micro_batch_size=2),
        learner=LearnerConfig(data_parallel="fsdp2"),
        group=group,
    )


class Peak:
    """Peak RSS over a block minus the RSS before it (MiB): freed heap returned first (malloc_trim), the
    high-water mark reset through /proc/self/clear_refs."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL("libc.so.6")
        self.extra_mib = 0.0

    @staticmethod
    def _status(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def __enter__(self) -> Peak:
        self._libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self._before = self._status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.extra_mib = self._status("VmHWM") - self._before


def _sync_parts(learner, size: str):
    """What a learner rank's host holds for a colocated weight sync: the runtime's `LearnerWeights` over the
    learner and an HF rollout engine (another initialization) that the push loads into."""
    from yatt_apps.runtime.learner_weights import LearnerWeights
    from yatt_rollout.hf_engine import HFEngine

    return LearnerWeights(learner, "fsdp2"), HFEngine(_model(size, 3), seed=0)


def _rank(rank: int, world: int, port: int, size: str, out: Path) -> None:
    import torch.distributed as dist
    from yatt_controller.weight_sync import copy_local

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    learner = _learner(size, 0, group)
    batch_a, batch_b = _batch(1, rows=2 * world), _batch(2, rows=2 * world)

    def shard(batch):
        return {k: v[rank * 2 : (rank + 1) * 2] for k, v in batch.items()}

    learner.update(shard(batch_a))
    result: dict = {}
    dist.barrier()
    with Peak() as peak:
        start = time.perf_counter()
        learner.save_shards(str(out / "sync"))
        files = learner.wait_shards()
        result["sync_s"] = time.perf_counter() - start
    result["save_extra_mib"] = peak.extra_mib
    result["rank_bytes"] = sum(size for _, size in files.values())
    dist.barrier()
    with Peak() as peak:  # the memory of a background save alone (no step beside it to count)
        learner.save_shards(str(out / "async-memory"), background=True)
        learner.wait_shards()
    result["async_extra_mib"] = peak.extra_mib
    dist.barrier()
    start = time.perf_counter()
    learner.save_shards(str(out / "async"), background=True)
    result["async_block_s"] = time.perf_counter() - start
    result["loss_b"] = learner.update(shard(batch_b)).loss  # trains while the files are written
    learner.wait_shards()
    dist.barrier()
    weights, engine = _sync_parts(learner, size)
    dist.barrier()
    with Peak() as peak:  # the runtime's streamed sync: each bucket gathered, loaded, freed
        while weights.next_bucket(64 << 20) > 0:  # every rank together, as phases.sync_weights drives it
            copy_local(weights, engine, version=1)  # the colocated push into this rank's engine
            dist.barrier()
    result["sync_stream_extra_mib"] = peak.extra_mib
    dist.barrier()
    with Peak() as peak:  # the whole model gathered first, then one push (an async step's path)
        weights.gather_all()
        copy_local(weights, engine, version=2)
    result["gather_all_extra_mib"] = peak.extra_mib
    result["model_mib"] = sum(t.numel() * t.element_size() for _, t in weights.named_weights()) / 2**20
    weights.release()
    del engine
    dist.barrier()
    if rank == 0:
        alone = _learner(size, 7, None)  # another initialization, world size 1
        alone.load_shards(str(out / "async"))
        result["resumed_loss_b"] = alone.update(batch_b).loss
        full = alone.engine.shards.tensors()
        result["full_bytes"] = sum(
            t.numel() * t.element_size()
            for part in (full["model"], full["optim"].get("state", {}))
            for t in _tensors(part)
        )
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    if args.rank is not None:
        _rank(args.rank, 2, args.port, size, Path(args.out))
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        # large allocations mmap'd, so freed tensors leave the RSS (glibc's heap would keep them counted)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        port = _free_port()
        cmd = [
            sys.executable,
            __file__,
            *(["--quick"] if args.quick else []),
            "--port",
            str(port),
            "--out",
            tmp,
        ]
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(2)]
        if any(p.wait() for p in procs):
            raise SystemExit("a rank failed")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    zero, model_mib = ranks[0], ranks[0]["model_mib"]

    def worst(key: str) -> float:
        return round(max(r[key] for r in ranks) / model_mib, 3)

    save, sync = worst("save_extra_mib"), worst("sync_stream_extra_mib")
    resumed_ok = abs(zero["resumed_loss_b"] - zero["loss_b"]) <= 1e-4 * max(abs(zero["loss_b"]), 1e-6)
    result = {
        "model": f"qwen2 {SIZES[size]} ({model_mib:.0f} MiB fp32)",
        "bytes_per_rank_over_full": round(max(r["rank_bytes"] for r in ranks) / zero["full_bytes"], 3),
        "save_blocking_over_sync_save": round(
            max(r["async_block_s"] for r in ranks) / max(r["sync_s"] for r in ranks), 3
        ),
        "peak_extra_mib_over_model_mib": max(save, sync),
        "peak_extra_mib_over_model_mib.save": save,
        "peak_extra_mib_over_model_mib.weight_sync": sync,
        "peak_extra_mib_over_model_mib.save_async_staging": worst("async_extra_mib"),
        "peak_extra_mib_over_model_mib.gather_all": worst("gather_all_extra_mib"),
        "reshard_resume_ok": int(resumed_ok),
        "loss_next_batch_2_ranks": zero["loss_b"],
        "loss_next_batch_resumed_1_rank": zero["resumed_loss_b"],
        "sync_save_s": round(max(r["sync_s"] for r in ranks), 3),
        "async_save_blocking_s": round(max(r["async_block_s"] for r in ranks), 3),
        "full_state_mib": round(zero["full_bytes"] / 2**20, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
