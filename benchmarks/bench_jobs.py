"""The jobs' learning benchmarks: each shipped job's embedded default run for a few minutes, reporting whether
it learns by the issue's targets. One function per job (`distill`, ...), each returning its keys; `main` joins
the ones asked for.

- `distill`: `yatt distill`'s `tiny_cpu_distill` (the tiny student distils the wider warm-started teacher)
  through `yatt_apps.runtime.launch.run_job`; `distill.reverse_kl_drop` = (first - last) / first of
  `distill/reverse_kl` (first and last: the means over the run's first and last three steps, since one step's
  batch estimate is noisy), target >= 0.3; `distill.student_acc_gain` = the student's last `val/accuracy`
  minus its first (step 0), target >= 0.1; `distill.teacher_accuracy` beside it. `--quick` and the full run
  are the preset's 30 steps (about 1-2 s each on 2 cores: learning needs them). The warm starts are cached
  (~/.cache/yatt/models); a cold cache adds them to `distill.wall_s`.

    python benchmarks/bench_jobs.py --quick [--jobs distill]

The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def distill(quick: bool) -> dict:
    """`yatt distill`'s embedded default: the reverse KL's relative drop and the student's accuracy gain."""
    import msgspec
    from yatt_apps.jobs.distill import JOB, tiny_cpu_distill
    from yatt_apps.runtime.launch import run_job

    cfg = tiny_cpu_distill()  # `quick` runs it as is: fewer steps would not show the learning
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, progress=False))
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        started = time.perf_counter()
        summary = run_job(cfg, Path(tmp) / "run", JOB, existing="refuse")
        rows = _metrics(Path(tmp) / "run")
    kl = [row["distill/reverse_kl"] for row in rows]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    acc = [row["val/accuracy"] for row in rows if "val/accuracy" in row]
    teacher = [row["val/teacher_accuracy"] for row in rows if "val/teacher_accuracy" in row]
    return {
        "distill.reverse_kl_drop": round((first - last) / first, 4),
        "distill.student_acc_gain": round(acc[-1] - acc[0], 4),
        "distill.reverse_kl": [round(v, 4) for v in kl],
        "distill.student_accuracy": acc,
        "distill.teacher_accuracy": teacher[0],
        "distill.steps": len(rows),
        "distill.wall_s": round(time.perf_counter() - started, 1),
        "distill.run_s": round(summary["seconds"], 1),
    }


JOBS = {"distill": distill}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter runs (a few minutes per job on 2 cores)"
    )
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS), help="which jobs to run")
    args = parser.parse_args(argv)
    for key, value in {
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)
    result: dict = {"benchmark": "jobs", "quick": args.quick, "load_avg_1m": round(os.getloadavg()[0], 2)}
    for name in args.jobs:
        result |= JOBS[name](args.quick)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
