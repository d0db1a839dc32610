"""The jobs' learning benchmarks: each shipped job's embedded default run for a few minutes through the real job
(`yatt_apps.runtime.launch.run_job`, one local Ray session), reporting whether it learns by issue 28's targets.
One function per job, each returning its `JOB.key` figures; `main` joins the ones asked for.

- `dpo`: `tiny_cpu_dpo` (the warm-started tiny policy, DPO + RPO on the arithmetic task's pairs, two parallel
  controllers). Validation preference accuracy: the share of validation pairs whose chosen reward is above the
  rejected one, a tie counting half (the job evaluates before each step's update, as `yatt grpo`, so step 0 is
  the reference itself: every reward 0, accuracy 0.5, chance). `dpo.accuracy_rise`: its value at the last
  evaluated step minus step 0's; the target of issue 28 is >= 0.2. `dpo.accuracy_rise_from_step1`: the same
  from step 1, the first evaluation after an update (what the training adds beyond its first step).
  `dpo.gen_accuracy_first` / `_last`: greedy generation accuracy (math_verify) on the same prompts, the first
  the warm-started policy's. `--quick` runs 20 steps, the full run the preset's 30; both evaluate every step
  (`run.eval_every` 1 instead of the preset's 5: evaluation runs before the update and does not change the
  training).
- `distill`: `tiny_cpu_distill` (the shared tiny policy distils the wider warm-started teacher with the dense
  top-16 reverse KL); `distill.reverse_kl_drop` = (first - last) / first of `distill/reverse_kl` (the
  sampled-token estimate; first and last: the means over the run's first and last three steps, since one step's
  batch estimate is noisy), target >= 0.3; `distill.student_acc_gain` = the student's last `val/accuracy`
  (greedy, 256 validation rows) minus its first (step 0), target > 0 (issue 28: >= 0.1);
  `distill.teacher_accuracy` beside it, and the student's sampled accuracy (`reward/mean`, means of the first
  and last three steps). `--quick` and the full run are the preset's 60 steps.

    python benchmarks/bench_jobs.py --quick [--jobs dpo distill]

The warm starts are cached (~/.cache/yatt/models); a cold cache adds them to the wall times. The last printed
line is one JSON object (every job's figures, the load average at start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def dpo(quick: bool) -> dict:
    """`yatt dpo`'s embedded default: validation preference accuracy rise, generation accuracy, wall time."""
    import msgspec
    from yatt_apps.jobs.dpo import JOB, tiny_cpu_dpo
    from yatt_apps.runtime.launch import run_job

    cfg = tiny_cpu_dpo()
    steps = 20 if quick else cfg.run.num_steps
    run = msgspec.structs.replace(cfg.run, num_steps=steps, eval_every=1, progress=False)
    cfg = msgspec.structs.replace(cfg, run=run)
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        started = time.perf_counter()
        run_job(cfg, Path(tmp) / "run", JOB)
        seconds = time.perf_counter() - started
        rows = {row["step"]: row for row in _rows(Path(tmp) / "run")}
    evaluated = [rows[s] for s in sorted(rows) if "val/dpo/accuracy" in rows[s]]
    first, last = evaluated[0], evaluated[-1]
    return {
        "dpo.accuracy_rise": round(last["val/dpo/accuracy"] - first["val/dpo/accuracy"], 4),
        "dpo.accuracy_rise_from_step1": round(last["val/dpo/accuracy"] - rows[1]["val/dpo/accuracy"], 4),
        "dpo.val_pref_accuracy": [round(row["val/dpo/accuracy"], 4) for row in evaluated],
        "dpo.gen_accuracy": [round(row["val/accuracy"], 4) for row in evaluated],
        "dpo.val_margin_last": round(last["val/dpo/margin"], 4),
        "dpo.gen_accuracy_first": first["val/accuracy"],
        "dpo.gen_accuracy_last": last["val/accuracy"],
        "dpo.steps": float(steps),
        "dpo.seconds": round(seconds, 1),
    }


def distill(quick: bool) -> dict:
    """`yatt distill`'s embedded default: the reverse KL's relative drop and the student's accuracy gain."""
    import msgspec
    from yatt_apps.jobs.distill import JOB, tiny_cpu_distill
    from yatt_apps.runtime.launch import run_job

    cfg = tiny_cpu_distill()  # `quick` runs it as is (60 steps): fewer would not show the learning
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, progress=False))
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        started = time.perf_counter()
        summary = run_job(cfg, Path(tmp) / "run", JOB, existing="refuse")
        rows = _rows(Path(tmp) / "run")
    kl = [row["distill/reverse_kl"] for row in rows]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    acc = [row["val/accuracy"] for row in rows if "val/accuracy" in row]
    teacher = [row["val/teacher_accuracy"] for row in rows if "val/teacher_accuracy" in row]
    sampled = [row["reward/mean"] for row in rows]  # the student's sampled accuracy (math_verify) per step
    return {
        "distill.reverse_kl_drop": round((first - last) / first, 4),
        "distill.student_acc_gain": round(acc[-1] - acc[0], 4),
        "distill.reverse_kl": [round(v, 4) for v in kl],
        "distill.student_accuracy": [round(v, 4) for v in acc],
        "distill.student_sampled_acc_first_last": [
            round(sum(sampled[:3]) / 3, 4),
            round(sum(sampled[-3:]) / 3, 4),
        ],
        "distill.teacher_accuracy": teacher[0],
        "distill.steps": len(rows),
        "distill.wall_s": round(time.perf_counter() - started, 1),
        "distill.run_s": round(summary["seconds"], 1),
    }


JOBS = {"dpo": dpo, "distill": distill}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter runs (a few minutes per job on 2 cores)"
    )
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS), help="which jobs to run")
    args = parser.parse_args(argv)
    for key, value in {
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)
    out: dict = {"benchmark": "jobs", "quick": args.quick, "load_start": round(os.getloadavg()[0], 2)}
    for name in args.jobs:
        figures = JOBS[name](args.quick)
        print(f"{name}: {figures}", file=sys.stderr)
        out |= figures
    out["load_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
