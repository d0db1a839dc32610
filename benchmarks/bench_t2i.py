"""`yatt grpo-t2i`'s benchmark: the embedded default (`tiny_cpu_t2i`: a tiny SD3-style pipeline learning the
colour/position task) through the real job (`yatt_apps.runtime.launch.run_job`, one local Ray session).

- `t2i.reward_rise`: the validation pixel-rule reward (`val/reward/colour_position_mean`, scored by the job's
  reward role; 32 prompts: each colour x side pair twice, fixed seeds, evaluated before the step's update)
  at the last evaluated step minus step 0's; issue 30's target is >= 0.1 in the quick run.
- `t2i.images_per_s`: images the engines sampled per second of rollout (summed over the controllers' engines,
  which run side by side), the median over the run's steps.
- `driver_bytes_parallel` / `driver_bytes_single`: payload bytes through the driver per step (Ray's API
  counted, `controller.count_driver_bytes`), the first of the same config with two parallel controllers, the
  second with one driver-side controller (`controller.mode=single`, a few steps: each step moves the same
  images and latents): in parallel mode no image passes through the driver.

    python benchmarks/bench_t2i.py --quick

`--quick` runs the preset's 60 steps (validation every 5), the full run 120. The tiny pipeline is cached
(~/.cache/yatt/models/t2i-*); a cold cache adds its build (the VAE's 200 pretraining steps) to the first run.
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(cfg, name: str) -> tuple[list[dict], dict, float]:
    import yatt_apps.runtime.launch as launch
    from yatt_apps.jobs.grpo_t2i import JOB

    with tempfile.TemporaryDirectory(prefix=f"bench-t2i-{name}-") as tmp:
        started = time.perf_counter()
        result = launch.run_job(cfg, Path(tmp) / "run", JOB)
        seconds = time.perf_counter() - started
        rows = _rows(Path(tmp) / "run")
    return rows, result, seconds


def main() -> None:
    import msgspec
    from yatt_apps.jobs.grpo_t2i import tiny_cpu_t2i

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the preset's 60 steps (else 120)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    base = tiny_cpu_t2i()
    steps = base.run.num_steps if args.quick else 2 * base.run.num_steps
    counted = msgspec.structs.replace(base.controller, count_driver_bytes=True)
    cfg = msgspec.structs.replace(
        base,
        run=msgspec.structs.replace(base.run, num_steps=steps, schedule_steps=steps, progress=False),
        controller=counted,
    )
    rows, result, seconds = _run(cfg, "parallel")
    rule = "val/reward/colour_position_mean"  # the pixel rule's term (the default's only reward)
    evaluated = [r for r in rows if rule in r]
    single_steps = 3
    single = msgspec.structs.replace(
        cfg,
        run=msgspec.structs.replace(cfg.run, num_steps=single_steps, eval_every=0),
        controller=msgspec.structs.replace(counted, mode="single", num_controllers=1),
    )
    _, single_result, single_seconds = _run(single, "single")
    out = {
        "t2i.reward_rise": evaluated[-1][rule] - evaluated[0][rule],
        "t2i.val_reward_first": evaluated[0][rule],
        "t2i.val_reward_last": evaluated[-1][rule],
        "t2i.val_reward_steps": [r["step"] for r in evaluated],
        "t2i.train_reward_first3": statistics.mean(r["reward/mean"] for r in rows[:3]),
        "t2i.train_reward_last3": statistics.mean(r["reward/mean"] for r in rows[-3:]),
        "t2i.images_per_s": statistics.median(r["t2i/images_per_s"] for r in rows),
        "t2i.steps": steps,
        "t2i.seconds": seconds,
        "driver_bytes_parallel": result["driver_bytes"] / steps,
        "driver_bytes_single": single_result["driver_bytes"] / single_steps,
        "single_seconds": single_seconds,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
