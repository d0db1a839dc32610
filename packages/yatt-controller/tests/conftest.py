"""Ray settings for this package's tests when pytest runs with the package as its root (the workspace
conftest sets the same when run from the workspace): no auth token under $HOME, no usage stats.

It also loads the test doubles (`doubles.py`) and tiny models (`tiny_models.py`) beside it as the modules
`yatt_controller_doubles` and `yatt_controller_tiny_models` (tests/ is not a package), before pytest imports
the test modules that `import` them. Both import only light modules at import time."""

import importlib.util
import os
import sys
from pathlib import Path

for _key, _value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_key, _value)


def _load_beside(name: str) -> None:
    spec = importlib.util.spec_from_file_location(
        f"yatt_controller_{name}", Path(__file__).with_name(f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


for _name in ("doubles", "tiny_models"):
    _load_beside(_name)
