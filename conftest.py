"""Workspace-wide pytest setup: offline hubs, no Ray telemetry or auth token, and `gpu`-marked tests skip
where CUDA is absent."""

import os
import sys

import pytest

# Nothing is ever downloaded; Ray writes no token under $HOME and sends no usage stats.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # under `uv run`, Ray would package the whole checkout as every worker's working directory
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_session_across_modules():
    """Each test module starts without a Ray session in this process: one left by a module (a job's
    `run_job` leaves a Ray it did not start; a bare `ray.put` starts one) is shut down after it. The suite
    runs a file per pytest-xdist worker, so which module runs next in a process is not fixed."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)
