"""Warm-started tiny models shipped with yatt-apps, so that the first `yatt grpo` on a fresh machine does not
spend minutes warm-starting the default policy and judge (issue 34: the first run in minutes).

The files under `yatt_apps/assets/warm/KIND-KEY/` are what `warmstart.cached_or_build` writes into its cache
for the shipped jobs' default presets (the policy, the GenRM judge, CAPO's step critic, the distillation
teacher), made by this module's command from the project's own warm start code:

    uv run python -m yatt_apps.runtime.shipped            # rebuild them (minutes of CPU) into the package

KEY hashes what shapes the model (the spec's training fields, the tokenizer corpus, the task draw and
`warmstart.FORMAT_VERSION`), not the package versions, so a release that leaves the warm start alone keeps
them; a spec, corpus or recipe that differs (a user's data, other sizes, a changed recipe) misses and is warm
-started as before. Each folder's `warm_start.json` records the run that made it, the per-step losses
included: `apps/tests/test_shipped.py` retrains the first steps and checks they reproduce those losses.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import msgspec

from yatt_apps.config import ModelSpec

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "warm"


def ship_key(spec: ModelSpec, corpus: list[str]) -> str:
    """`warmstart.cache_key` without the package versions: what the weights depend on."""
    from yatt_apps.runtime.warmstart import FORMAT_VERSION, SERVING_FIELDS, TASK_ROWS, TASK_SEED

    shaping = {k: v for k, v in msgspec.to_builtins(spec).items() if k not in SERVING_FIELDS}
    doc = [shaping, corpus, TASK_ROWS, TASK_SEED, FORMAT_VERSION]
    return hashlib.sha256(msgspec.json.encode(doc)).hexdigest()[:16]


def find(spec: ModelSpec, corpus: list[str]) -> Path | None:
    """The shipped folder of this warm start, or None (then it is trained)."""
    folder = ASSETS / f"{spec.warm_start}-{ship_key(spec, corpus)}"
    complete = all(
        (folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")
    )
    return folder if complete else None


def rebuild() -> list[Path]:
    """Warm-start every shipped job's default tiny models from scratch (an empty cache, nothing shipped used),
    prepared exactly as a run prepares them (the job's `prepare`, its dataset), and store them under ASSETS,
    replacing what was there."""
    from yatt_apps.jobs import registry
    from yatt_apps.runtime.launch import prepare_models, train_rows

    saved = {key: os.environ.get(key) for key in ("YATT_CACHE_DIR", "YATT_NO_SHIPPED")}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["YATT_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ["YATT_NO_SHIPPED"] = "1"
        try:
            for job in registry().values():
                cfg, run = job.preset(), Path(tmp) / job.name
                if job.prepare is not None:
                    cfg = job.prepare(cfg, run)
                prepare_models(cfg, run, job.dataset or train_rows)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        shutil.rmtree(ASSETS, ignore_errors=True)
        ASSETS.mkdir(parents=True)
        made = []
        for folder in sorted((Path(tmp) / "cache").iterdir()):
            report = msgspec.json.decode((folder / "warm_start.json").read_bytes())
            out = ASSETS / f"{report['kind']}-{report['ship_key']}"
            shutil.copytree(folder, out)
            made.append(out)
    return made


if __name__ == "__main__":
    for path in rebuild():
        print(path, file=sys.stderr)
