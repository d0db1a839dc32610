"""Warm-started tiny models shipped with yatt-apps, so that the first `yatt grpo` on a fresh machine does not
spend minutes warm-starting the default policy and judge (issue 34: the first run in minutes).

The files under `yatt_apps/assets/warm/KIND-KEY/` are what `warmstart.cached_or_build` writes into its cache
for the shipped jobs' default presets (the policy, the GenRM judge, CAPO's step critic, the distillation
teacher), and the agentic preset's multi-turn SFT warm start (`agent-KEY`: `tiny_cpu_agent`, the folder
`agent_warmstart.warm_started` caches), made by this module's command from the project's own warm start code:

    uv run python -m yatt_apps.runtime.shipped            # rebuild them all (minutes of CPU) into the package
    uv run python -m yatt_apps.runtime.shipped agent      # only the agent one (about 10 minutes); or: models

KEY hashes what shapes the model (the spec's training fields, the tokenizer corpus, the task draw and
`warmstart.FORMAT_VERSION`; the agent's: its spec, environment, SFT steps and demonstrations, and
`agent_warmstart.FORMAT_VERSION`), not the package versions, so a release that leaves the warm start alone keeps
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
from collections.abc import Collection
from pathlib import Path

import msgspec

from yatt_apps.config import ModelSpec, RunConfig

PARTS = ("models", "agent")  # what `rebuild` makes: the jobs' default warm starts, the agentic preset's
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "warm"


def ship_key(spec: ModelSpec, corpus: list[str]) -> str:
    """`warmstart.cache_key` without the package versions: what the weights depend on."""
    from yatt_apps.runtime.warmstart import FORMAT_VERSION, SERVING_FIELDS, TASK_ROWS, TASK_SEED

    shaping = {k: v for k, v in msgspec.to_builtins(spec).items() if k not in SERVING_FIELDS}
    doc = [shaping, corpus, TASK_ROWS, TASK_SEED, FORMAT_VERSION]
    return hashlib.sha256(msgspec.json.encode(doc)).hexdigest()[:16]


def find(spec: ModelSpec, corpus: list[str]) -> Path | None:
    """The shipped folder of this warm start, or None (then it is trained)."""
    return _complete(ASSETS / f"{spec.warm_start}-{ship_key(spec, corpus)}")


def find_agent(cfg: RunConfig) -> Path | None:
    """The shipped folder of this agentic warm start (`agent_warmstart.warm_started`), or None."""
    from yatt_apps.runtime.agent_warmstart import ship_key as agent_key

    return _complete(ASSETS / f"agent-{agent_key(cfg)}")


def _complete(folder: Path) -> Path | None:
    names = ("config.json", "model.safetensors", "tokenizer.json", "warm_start.json")
    return folder if all((folder / name).is_file() for name in names) else None


def rebuild(parts: Collection[str] = PARTS) -> list[Path]:
    """Warm-start the shipped tiny models from scratch (an empty cache, nothing shipped used), prepared exactly
    as a run prepares them, and store them under ASSETS, replacing the folders of the parts built (the others
    are left as they are). Parts: "models", every shipped job's default models (the job's `prepare`, its
    dataset); "agent", the `tiny_cpu_agent` preset's multi-turn SFT warm start."""
    from yatt_apps.config import tiny_cpu_agent
    from yatt_apps.jobs import registry
    from yatt_apps.runtime import agent_warmstart
    from yatt_apps.runtime.launch import prepare_models, train_rows

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"shipped.rebuild: unknown parts {unknown}; the parts are {list(PARTS)}")
    saved = {key: os.environ.get(key) for key in ("YATT_CACHE_DIR", "YATT_NO_SHIPPED")}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["YATT_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ["YATT_NO_SHIPPED"] = "1"
        try:
            for job in registry().values() if "models" in parts else ():
                cfg, run = job.preset(), Path(tmp) / job.name
                if job.prepare is not None:
                    cfg = job.prepare(cfg, run)
                prepare_models(cfg, run, job.dataset or train_rows)
            if "agent" in parts:
                agent_warmstart.prepare(tiny_cpu_agent(), Path(tmp) / "agent")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        ASSETS.mkdir(parents=True, exist_ok=True)
        for old in ASSETS.iterdir():
            if ("agent" if old.name.startswith("agent-") else "models") in parts:
                shutil.rmtree(old)
        made = []
        for folder in sorted((Path(tmp) / "cache").iterdir()):
            report = msgspec.json.decode((folder / "warm_start.json").read_bytes())
            out = ASSETS / f"{report['kind']}-{report['ship_key']}"
            shutil.copytree(folder, out)
            made.append(out)
    return made


if __name__ == "__main__":
    for path in rebuild(sys.argv[1:] or PARTS):
        print(path, file=sys.stderr)
