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
    _heaviest_files_first(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)


# The files that took a minute or more of a CI run (`--durations`), longest first. The suite's two workers take
# whole files in collection order (`--dist loadfile --no-loadscope-reorder`: without the second flag xdist
# reorders the files by their number of tests, which put the long few-test files last and left one worker
# about 100 s behind the other): a long file started last leaves the other worker idle at the end, so these
# go first. A file missing here only runs in its usual place.
HEAVIEST = (
    "apps/tests/test_backends.py",
    "apps/tests/test_run_lifecycle.py",
    "tests/test_examples.py",
    "packages/yatt-rollout/tests/test_vllm_weights.py",
    "apps/tests/test_grpo_t2i.py",
    "apps/tests/test_agent_job.py",
    "apps/tests/test_placement_modes.py",
    "packages/yatt-controller/tests/test_runtime.py",
    "apps/tests/test_async.py",
    "apps/tests/test_two_node.py",
    "apps/tests/test_grpo_e2e.py",
)


def _heaviest_files_first(items) -> None:
    """`HEAVIEST` first, in its order; every other file after them in collection order; each file's tests in
    their own order (a stable sort: both workers collect the same order)."""
    rank = {path: index for index, path in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(HEAVIEST)))
