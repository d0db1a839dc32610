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
    # jobs run one after another in a test process keep their host processes for the next job on the same
    # bundles (yatt_controller.warm): a host's start is seconds of imports; a job in a fresh process (the CLI
    # tests) starts its own Ray and hosts as a user's does
    "YATT_KEEP_HOSTS": "1",
}.items():
    os.environ.setdefault(_key, _value)


# The GCS address of the Ray session that apps/tests/conftest.py's `ray_session` shares between the modules of
# one test process (set there; a variable, as the two conftest files do not import each other).
SHARED_RAY = "YATT_TESTS_SHARED_RAY"


@pytest.fixture(autouse=True, scope="module")
def _no_ray_session_across_modules():
    """Each test module starts without a Ray session in this process, except the shared one (`SHARED_RAY`):
    any other one left by a module (a job's `run_job` leaves a Ray it did not start; a bare `ray.put` starts
    one) is shut down after it. The suite runs a file per pytest-xdist worker, so which module runs next in a
    process is not fixed."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if ray.get_runtime_context().gcs_address != os.environ.get(SHARED_RAY):
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
