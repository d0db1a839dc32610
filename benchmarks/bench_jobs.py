"""The offline and distillation jobs' learning on their embedded defaults: one function per job, each running the
real job (`yatt_apps.runtime.launch.run_job` with the job's default preset, in one local Ray session) and
returning its figures as `JOB.key` entries.

- `dpo`: `tiny_cpu_dpo` (the warm-started tiny policy, DPO + RPO on the arithmetic task's pairs, two parallel
  controllers). `dpo.accuracy_rise`: validation preference accuracy (chosen reward strictly above rejected,
  on the validation pairs) at the last evaluated step minus the first; the target of issue 28 is >= 0.2. The job
  evaluates before each step's update (as `yatt grpo`), so step 0 is the reference itself, whose accuracy is
  0 by definition (every reward 0): `dpo.accuracy_rise_from_step5` measures from the first trained policy
  instead (5 updates). `dpo.gen_accuracy_first` / `_last`: greedy generation accuracy (math_verify) on the
  same prompts, the first being the warm-started policy's. `--quick` runs 20 steps (evaluated at 0, 5, 10, 15,
  19), the full run the preset's 30.

    python benchmarks/bench_jobs.py --quick

The last printed line is one JSON object (figures of every job run, the load average at start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row for row in rows}


def dpo(quick: bool) -> dict:
    """`yatt dpo`'s embedded default: validation preference accuracy rise, generation accuracy, wall time."""
    import msgspec
    from yatt_apps.jobs.dpo import JOB, tiny_cpu_dpo
    from yatt_apps.runtime.launch import run_job

    cfg = tiny_cpu_dpo()
    steps = 20 if quick else cfg.run.num_steps
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, num_steps=steps, progress=False))
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        started = time.perf_counter()
        run_job(cfg, Path(tmp) / "run", JOB)
        seconds = time.perf_counter() - started
        rows = _metrics(Path(tmp) / "run")
    evaluated = [rows[s] for s in sorted(rows) if "val/dpo/accuracy" in rows[s]]
    first, last = evaluated[0], evaluated[-1]
    return {
        "dpo.accuracy_rise": last["val/dpo/accuracy"] - first["val/dpo/accuracy"],
        "dpo.accuracy_rise_from_step5": last["val/dpo/accuracy"] - rows[5]["val/dpo/accuracy"],
        "dpo.val_pref_accuracy": [row["val/dpo/accuracy"] for row in evaluated],
        "dpo.gen_accuracy": [row["val/accuracy"] for row in evaluated],
        "dpo.val_pref_accuracy_first": first["val/dpo/accuracy"],
        "dpo.val_pref_accuracy_last": last["val/dpo/accuracy"],
        "dpo.val_margin_last": last["val/dpo/margin"],
        "dpo.gen_accuracy_first": first["val/accuracy"],
        "dpo.gen_accuracy_last": last["val/accuracy"],
        "dpo.steps": float(steps),
        "dpo.seconds": seconds,
    }


JOBS = {"dpo": dpo}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per job")
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=list(JOBS), help="jobs to run")
    args = parser.parse_args(argv)
    out: dict = {"quick": args.quick, "load_start": os.getloadavg()[0]}
    for name in args.jobs:
        figures = JOBS[name](args.quick)
        print(f"{name}: {figures}", file=sys.stderr)
        out |= figures
    out["load_end"] = os.getloadavg()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
