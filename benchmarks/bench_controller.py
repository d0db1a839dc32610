"""Single controller against 1, 2 and 4 parallel controllers on a multimodal payload (yatt-controller), at
equal work: the same 4 learner ranks and the same 4 rollout replicas in every configuration.

Each step generates one sample per prompt, each carrying an image-sized uint8 array (4 MiB by default, 64
prompts: 256 MiB of media per step), and hands every sample to a learner rank, which reads its pixels and
trains a real tiny transformer (yatt_rollout.tiny, a Qwen2 of hidden 64) one step on tokens drawn from them.
The single controller (the verl-style baseline) runs in the driver, fetches every sample and sends it on to
the 4 learner ranks; with n parallel controllers each drives 4/n learner ranks and its share of the batch,
and the driver only watches. Measured side by side in one run: step time (median over the steps after a
warm-up step), bytes through the driver (counted at Ray's API in the driver process: every remote call's
arguments and results, every get and put), and dispatch overhead (every other step carries no media: its
time is the cost of dispatching, collecting and the model compute alone). Where the speedup comes from:
each configuration's `media_s` (its media step's time minus its empty step's) is what moving the media
costs it, and `dispatch_overhead_ms` the rest: `media_s` of single minus that of a parallel configuration is
the time saved by keeping media out of the driver, the overheads' difference the time saved in dispatch. Last line: one JSON object.

    python benchmarks/bench_controller.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import ray
from yatt_controller.runner import Job, Services, run
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool, WorkerGroup
from yatt_placement.realize import realize, release
from yatt_placement.types import PlacementPlan, RolePlacement

NUM_ENGINES = 4
MiB = 2**20


class MediaEngine:
    """A rollout stand-in: a sample per prompt with an image-sized array (a copy of one of a few images)."""

    def __init__(self, media_bytes: int, seed: int):
        rng = np.random.default_rng(seed)
        self.images = [rng.integers(0, 256, size=media_bytes, dtype=np.uint8) for _ in range(4)]

    def generate(self, prompts: list[int], with_media: bool) -> list[dict]:
        return [
            {"prompt": p, "reward": float(p % 3), "pixels": self.images[p % 4].copy() if with_media else None}
            for p in prompts
        ]


class MediaLearner:
    """A learner rank: reads every sample's pixels (one byte per page) and trains a real tiny causal LM one
    step on token ids drawn from them (prompt ids when a sample has no media); returns a checksum."""

    def __init__(self) -> None:
        import torch
        from yatt_rollout.tiny import tiny_causal_lm

        torch.set_num_threads(1)
        self.model = tiny_causal_lm(256, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def train(self, samples: list[dict]) -> float:
        import torch

        rows = [
            s["pixels"][::4096][:64] if s["pixels"] is not None else np.full(64, s["prompt"] % 256)
            for s in samples
        ]
        ids = torch.tensor(np.stack(rows).astype(np.int64) % 256)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()
        return float(sum(int(r.sum()) for r in rows)) + 1.0


def media_step(ctx, batch: list[int]) -> dict[str, float]:
    """Odd steps carry media, even steps none (step 0, the warm-up, included)."""
    with ctx.phase("rollout"):
        refs = ctx.services["rollout"].scatter("generate", batch, with_media=ctx.step % 2 == 1)
        samples = [s for chunk in ctx.get(refs) for s in chunk]
    mean = sum(s["reward"] for s in samples) / len(samples)
    for sample in samples:  # the controller's own work on its samples: group-relative advantages
        sample["advantage"] = sample["reward"] - mean
    with ctx.phase("train"):
        checksums = ctx.get(ctx.learner.gather(ctx.learner.scatter("train", samples)))
    return ctx.all_reduce({"num_samples": len(samples), "checksum": sum(checksums)})


def _measure(realized, engines: WorkerGroup, mode: str, num_controllers: int, args) -> dict:
    def build(pool: HostPool) -> Services:  # engines outlive runs (another pool); learners are rebuilt
        learner = WorkerGroup.create(pool, "actor", MediaLearner)  # 4 ranks in every configuration
        return Services(groups={"actor": learner, "rollout": engines}, learner="actor")

    num_steps = 1 + 2 * args.steps  # a warm-up step, then media and empty steps alternating
    job = Job(
        build=build,
        step_fn=media_step,
        dataset=lambda: list(range(10_000)),
        batch_size=args.batch_size,
        num_steps=num_steps,
    )
    # the driver-byte ledger is opt-in: this benchmark's figure is what it measures
    spec = ControllerSpec(
        mode=mode, num_controllers=num_controllers, heartbeat_interval_s=1.0, count_driver_bytes=True
    )
    result = run(spec, job, realized)

    def step_s(step: int) -> float:  # a step lasts as long as its slowest controller
        return max(r.timings_s["step"] for r in result.reports[step])

    return {
        "step_s": statistics.median(step_s(s) for s in range(1, num_steps, 2)),
        "overhead_s": statistics.median(step_s(s) for s in range(2, num_steps, 2)),
        "driver_mb_per_step": result.driver_bytes / args.steps / MiB,  # media steps carry (nearly) all
        "driver_bytes": result.driver_bytes,
        "checksum": result.reports[1][0].metrics["checksum"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="3 measured steps (minutes on a busy 2-core machine)"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--media-mb", type=float, default=4.0, help="media per sample, MiB")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 10)
    media_bytes = int(args.media_mb * MiB)
    if args.batch_size % 4:
        raise ValueError(f"--batch-size must divide over 4 controllers, got {args.batch_size}")

    ray.init(
        address="local", num_cpus=16, num_gpus=16, include_dashboard=False, object_store_memory=2048 * MiB
    )
    roles = [RolePlacement(role="rollout", replicas=[[d] for d in range(NUM_ENGINES)])]
    engine_plan = realize(PlacementPlan(mode="disaggregated", num_devices=NUM_ENGINES, roles=roles))
    engine_pool = HostPool(engine_plan)
    engines = WorkerGroup.create(
        engine_pool, "rollout", MediaEngine, kwargs={"media_bytes": media_bytes, "seed": 0}
    )
    learners = [RolePlacement(role="actor", replicas=[[d] for d in range(NUM_ENGINES)])]
    realized = realize(PlacementPlan(mode="disaggregated", num_devices=NUM_ENGINES, roles=learners))
    configs = [("single", 1), ("parallel", 1), ("parallel", 2), ("parallel", 4)]
    results = {}
    started = time.perf_counter()
    for mode, n in configs:
        name = "single" if mode == "single" else f"parallel_{n}"
        media = _measure(realized, engines, mode, n, args)
        results[name] = {
            "step_s": round(media["step_s"], 4),
            "driver_mb_per_step": round(media["driver_mb_per_step"], 2),
            "dispatch_overhead_ms": round(1000 * media["overhead_s"], 2),
            # a media step's time beyond an empty step's: what moving the media costs this configuration
            "media_s": round(media["step_s"] - media["overhead_s"], 4),
            "driver_bytes": media["driver_bytes"],
        }
        print(
            f"{name:>11}: step {media['step_s']:.3f} s, driver {media['driver_mb_per_step']:.1f} MiB/step, "
            f"dispatch overhead {1000 * media['overhead_s']:.1f} ms (checksum {media['checksum']:.0f})",
            file=sys.stderr,
        )
        assert media["checksum"] > 0, "the learners saw no pixels"
    single = results["single"]["step_s"]
    speedup = {name: round(single / r["step_s"], 2) for name, r in results.items() if name != "single"}
    summary = {
        "bench": "controller",
        "media_mb_per_step": round(args.batch_size * media_bytes / MiB, 1),
        "steps": args.steps,
        "cpus": os.cpu_count(),
        "results": results,
        "learner_ranks": NUM_ENGINES,
        "speedup_vs_single": speedup,
        "equal_ranks": {"speedup_vs_single": speedup},
        "equal_ranks.speedup_vs_single": speedup,
        "driver_bytes_parallel": {n: r["driver_bytes"] for n, r in results.items() if n != "single"},
        "driver_bytes_single": results["single"]["driver_bytes"],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    engine_pool.shutdown()
    for plan in (realized, engine_plan):
        release(plan)
    ray.shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
