"""`import yatt_<pkg>` and `yatt_<pkg>.types` load msgspec only: none of torch, transformers, ray, vllm.

Each package is checked in a fresh interpreter, so one package's imports cannot hide another's.
"""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray", "vllm", "numpy")
PACKAGES = ["placement", "rollout", "algos", "multimodal", "controller", "apps"]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_import_is_light(pkg):
    code = (
        f"import json, sys, yatt_{pkg}\n"
        f"if '{pkg}' != 'apps': import yatt_{pkg}.types\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], f"yatt_{pkg} pulled in heavy modules"
