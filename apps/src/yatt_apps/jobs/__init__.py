"""The jobs: one module per job, each ending with `JOB = JobDef(...)` (`runtime.job`), and the registry the
`yatt` command, `yatt config` and `yatt plan` read.

Rule of this room: a job module holds its step function and its declaration; it calls the runtime's shared
phases and never starts Ray or parses arguments itself. Adding a job is adding a module here and its name to
`JOB_MODULES` (or, outside the package, a file run with `yatt run FILE.py`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from yatt_apps.config import RunConfig
    from yatt_apps.runtime.job import JobDef

# the shipped jobs' modules, in `yatt --help` order (Bone Soup `merge` is a plain command, not a JobDef)
JOB_MODULES = ("grpo", "dapo", "ppo", "capo", "vlm", "sft", "dpo", "distill", "grpo_t2i")


@functools.cache
def registry() -> dict[str, JobDef]:
    """Job name -> its declaration, over the shipped modules (imported once; they load no torch or Ray)."""
    jobs = [importlib.import_module(f"yatt_apps.jobs.{module}").JOB for module in JOB_MODULES]
    return {job.name: job for job in jobs}


def find(name: str) -> JobDef:
    """The shipped job called `name` (a config's `app`), or a ValueError listing the known names."""
    jobs = registry()
    if name not in jobs:
        raise ValueError(f"app {name!r} is not one of {sorted(jobs)} (a job of your own: yatt run FILE.py)")
    return jobs[name]


def presets() -> dict[str, Callable[[], RunConfig]]:
    """Every named preset: the config module's, then each shipped job's default under its function's name (a
    job whose config class and preset live in its own module needs no entry in `config.PRESETS`)."""
    from yatt_apps.config import PRESETS

    out = dict(PRESETS)
    for job in registry().values():
        out.setdefault(job.preset.__name__, job.preset)
    return out


def load_file(path: str | Path) -> JobDef:
    """The `JOB` a user's Python file declares (`yatt run path/to/job.py`). The file is imported as a module
    named after it, so its step function and workers can be found again by Ray's workers (the file's folder
    is put on `sys.path` here and, through `PYTHONPATH`, for the processes Ray starts)."""
    import os

    from yatt_apps.runtime.job import JobDef

    file = Path(path).expanduser().resolve()
    if not file.is_file() or file.suffix != ".py":
        raise ValueError(f"{path}: not a Python file (yatt run takes a job file, e.g. examples/own_job.py)")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [folder, *paths] if p)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    job = getattr(module, "JOB", None)
    if not isinstance(job, JobDef):
        raise ValueError(f"{path}: defines no JOB = JobDef(...) (found {type(job).__name__} for JOB)")
    return job
