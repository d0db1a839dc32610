"""Asynchronous training with bounded staleness against synchronous, on the real tiny GRPO job with its judge.

The same job (`yatt_apps.runtime.launch.run_job`: tiny Qwen2 policy and judge, rule rewards + GenRM) on 4 logical
devices in a disaggregated layout, with `algo.max_staleness` 0, 1 and 2, same seeds, in one Ray session: median
seconds per step (start-up and the first steps excluded), completion tokens per second, the reward curve of
each, and the largest staleness any trained sample had.

Layout: `--learners N` learner devices (one controller and one learner rank each), the other devices rollout
and judge. The default is 1: on a 2-core machine the 4 "devices" share the cores, and async can only overlap
generation and judging with training where a core is left for them. With 2 learner ranks both cores train
and the judge, running beside them, slows training instead (measured on the idle machine, 2026-11-22:
`--learners 2` sync 0.340 s/step, async1 0.306 (1.11x), async2 0.269 (1.26x); logprobs + train grew from
0.16 to 0.26 s under async while rollout_reward, 0.15 s, was hidden). `--learners 1` in the same hour: sync
0.474 s/step (rollout_reward 0.217 + logprobs 0.065 + train 0.180), async1 0.340 (1.40x), async2 0.288
(1.65x), staleness never above its bound. On real devices (disjoint GPUs) the 2-rank case is the one that
pays: steps take max(generation, training) instead of their sum.

Partial rollouts (`--partial`, `rollout.partial=true`) resume nothing here: a tiny batch's generation is
done long before the push (`partial_resumed` 0); the job-level test uses a slow-decode test double for that.

    python benchmarks/bench_async.py --quick [--partial] [--learners N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def config(staleness: int, num_steps: int, partial: bool = False, learners: int = 1):
    import msgspec
    from yatt_apps.config import PRESETS, ControllerSpec, PlacementConfig
    from yatt_placement.types import ClusterSpec

    cfg = PRESETS["tiny_cpu"]()
    replace = msgspec.structs.replace
    return replace(
        cfg,
        run=replace(cfg.run, num_steps=num_steps, prompts_per_step=8, eval_every=0, progress=False),
        algo=replace(cfg.algo, max_staleness=staleness),
        rollout=replace(cfg.rollout, partial=partial and staleness > 0),
        controller=ControllerSpec(num_controllers=learners, heartbeat_interval_s=1.0, hang_timeout_s=300.0),
        placement=PlacementConfig(
            mode="disaggregated", cluster=ClusterSpec(num_nodes=1, devices_per_node=4, device_memory_gb=16.0)
        ),
    )


def run_all(num_steps: int, partial: bool = False, learners: int = 1) -> dict[int, list[dict]]:
    from yatt_apps.jobs.grpo import JOB
    from yatt_apps.runtime import local_ray
    from yatt_apps.runtime.launch import ENV, run_job

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    session = local_ray.start(num_cpus=32, num_gpus=8)
    out = {}
    try:
        with tempfile.TemporaryDirectory() as root:
            for k in (0, 1, 2):
                run_job(config(k, num_steps, partial, learners), Path(root) / f"k{k}", JOB)
                lines = (Path(root) / f"k{k}" / "metrics.jsonl").read_text().splitlines()
                out[k] = [json.loads(line) for line in lines]
    finally:
        session.shutdown()
    return out


def phase_medians(steps: list[dict]) -> dict[str, float]:
    """Median seconds of each phase of a step (`time/<phase>` of the metrics), for the profile line."""
    keys = ("rollout_reward", "advantages", "logprobs", "train", "weight_sync", "idle", "step")
    keys += ("rollout_s", "reward_s")  # busy seconds of the streamed rollout and reward stages
    return {k: round(statistics.median(s.get(f"time/{k}", 0.0) for s in steps), 3) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="12 steps per setting (start-up dominates: minutes per setting)"
    )
    parser.add_argument("--partial", action="store_true", help="async settings with rollout.partial=true")
    parser.add_argument(
        "--learners",
        type=int,
        default=1,
        help="learner devices (one controller each); the rest: rollout, judge",
    )
    args = parser.parse_args()
    began = time.perf_counter()
    # a tiny step takes well under a second and each setting's start-up far longer: 12 steps make the median
    # (of the 10 after the window fills) steadier at almost no cost
    num_steps = 12 if args.quick else 24
    runs = run_all(num_steps, args.partial, args.learners)
    skip = 2  # start-up and the async window filling
    step_s = {k: statistics.median(s["time/step"] for s in steps[skip:]) for k, steps in runs.items()}
    tokens = {
        k: statistics.median(s["throughput/tokens_per_s"] for s in steps[skip:]) for k, steps in runs.items()
    }
    staleness = max(s.get("async/staleness_max", 0.0) for k in (1, 2) for s in runs[k])
    print(
        f"tiny GRPO + judge, disaggregated on 4 logical devices ({args.learners} learner), {num_steps} steps each"
    )
    phases = {k: phase_medians(steps[skip:]) for k, steps in runs.items()}
    for k, steps in runs.items():
        curve = [round(s["reward/mean"], 3) for s in steps]
        print(f"  max_staleness {k}: {step_s[k]:.3f} s/step, {tokens[k]:.0f} tokens/s, reward {curve}")
        print(f"    where a step's time goes (median s): {phases[k]}")
    summary = {
        "quick": args.quick,
        "sync_step_s": round(step_s[0], 4),
        "async1_step_s": round(step_s[1], 4),
        "async2_step_s": round(step_s[2], 4),
        "async1_speedup": round(step_s[0] / step_s[1], 3),
        "async2_speedup": round(step_s[0] / step_s[2], 3),
        "max_observed_staleness": staleness,
        "tokens_per_s": {str(k): round(v, 1) for k, v in tokens.items()},
        "reward_curves": {str(k): [round(s["reward/mean"], 4) for s in steps] for k, steps in runs.items()},
        "overlap_s": {
            str(k): round(statistics.mean(s.get("async/rollout_train_overlap_s", 0.0) for s in steps), 4)
            for k, steps in runs.items()
        },
        "partial": args.partial,
        "learners": args.learners,
        "partial_resumed": {
            str(k): sum(s.get("async/partial_resumed", 0.0) for s in steps) for k, steps in runs.items()
        },
        "phase_s": {str(k): v for k, v in phases.items()},
        "wall_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
