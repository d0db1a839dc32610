"""Each package installs alone: its wheel, built from the workspace, goes into a fresh virtual environment
outside the workspace with only its declared dependencies, and imports.

uv resolves the dependencies from PyPI (and the local torch CPU wheel folder where this machine has one, so
a package that needs torch does not pull the multi-GB CUDA build). Sibling YATT packages come from the wheels
just built, never from the workspace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    # package -> (the YATT packages it may pull in, a module that must import)
    "yatt-placement": ({"yatt-placement"}, "yatt_placement.types"),
    "yatt-rollout": ({"yatt-rollout"}, "yatt_rollout.types"),
    "yatt-algos": ({"yatt-algos"}, "yatt_algos.tensor_codec"),
    "yatt-multimodal": ({"yatt-multimodal", "yatt-rollout"}, "yatt_multimodal.types"),
    "yatt-controller": ({"yatt-controller", "yatt-placement"}, "yatt_controller.types"),
}
TORCH_WHEELS = Path("/opt/wheels")


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    return uv


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for pkg in PACKAGES:
        subprocess.run(
            [_uv(), "build", "--package", pkg, "--wheel", "-o", str(out), "-q"], cwd=ROOT, check=True
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_package_installs_and_imports_alone(pkg, wheelhouse, tmp_path):
    allowed, module = PACKAGES[pkg]
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    subprocess.run(
        [_uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env, cwd=tmp_path
    )
    python = str(venv / "bin" / "python")
    cmd = [_uv(), "pip", "install", "-q", "--python", python, "--find-links", str(wheelhouse), pkg]
    if TORCH_WHEELS.is_dir():
        constraints = tmp_path / "constraints.txt"
        constraints.write_text("torch==2.13.0+cpu\n")
        cmd += ["--find-links", str(TORCH_WHEELS), "--constraint", str(constraints)]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path)

    listed = subprocess.run(
        [_uv(), "pip", "list", "--python", python, "--format", "freeze"],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout
    yatt = {line.split("==")[0] for line in listed.splitlines() if line.startswith("yatt-")}
    assert yatt == allowed, f"{pkg} installed {yatt}, expected {allowed}"

    code = f"import {module}, sys; print({module}.__name__); assert 'yatt_apps' not in sys.modules"
    out = subprocess.run(
        [python, "-c", code], check=True, env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.stdout.strip() == module
