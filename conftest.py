"""Workspace-wide pytest setup: offline hubs, no Ray telemetry or auth token, and `gpu`-marked tests skip
where CUDA is absent."""

import os

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
