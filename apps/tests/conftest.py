"""Shared by the apps tests: a reader of W&B's offline run files, one local Ray session per test process for
the jobs run in it (`run_job` leaves a Ray it did not start running), and `yatt` commands run in process."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest


def _read(run: Path):
    """The records of an offline W&B run's .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing (32 KiB blocks of chunks: crc32, little-endian length, type 1 full / 2 first /
    3 middle / 4 last; a block tail under 7 bytes is padding), each record a protobuf `Record`. Read while the
    W&B service still appends, the records end at the last whole chunk."""
    from wandb.proto import wandb_internal_pb2

    (file,) = run.glob("run-*.wandb")
    data = file.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # the service is still writing this chunk: the file ends before it
            return
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""
        elif kind == 0:
            chunk = b""


def _types(run: Path) -> list[str]:
    return [rec.WhichOneof("record_type") for rec in _read(run)]


def _history(run: Path) -> list[dict]:
    """The logged rows (W&B adds _step, _runtime, _timestamp)."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
        for rec in _read(run)
        if rec.WhichOneof("record_type") == "history"
    ]


@pytest.fixture
def wandb_records():
    pytest.importorskip("wandb")
    return SimpleNamespace(read=_read, types=_types, history=_history)


_OURS: dict = {}  # the Ray session ray_session started in this test process: its LocalRay and GCS address


@pytest.fixture(scope="session")
def _shared_ray():
    """Shuts down, at the end of the test process, the Ray session the modules shared."""
    yield
    if _OURS:
        _OURS.pop("session").shutdown()


@pytest.fixture(scope="module")
def ray_session(_shared_ray):
    """A local Ray with room for every layout the tests plan (logical devices), shared by the jobs of every
    module of this test process that asks for it: a module's jobs leave no actor behind (`run_job` ends its
    own), and a Ray start is seconds of two busy cores. Started as a job starts its own (`local_ray.start`:
    loopback only, its processes reaped, tried again when the start times out). A session this fixture did
    not start (a module with a Ray of its own) is shut down and a fresh one started."""
    import os

    import ray
    from yatt_apps.runtime import local_ray
    from yatt_apps.runtime.launch import ENV

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    ours = ray.is_initialized() and _OURS and ray.get_runtime_context().gcs_address == _OURS["address"]
    if not ours:
        if ray.is_initialized():
            ray.shutdown()
        if _OURS:  # ours was shut down by another module: its reaper and switches go too
            _OURS.pop("session").shutdown()
        _OURS["session"] = local_ray.start(num_cpus=32, num_gpus=16)
        _OURS["address"] = ray.get_runtime_context().gcs_address
        os.environ["YATT_TESTS_SHARED_RAY"] = _OURS["address"]  # the workspace conftest leaves this one up
    yield


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """The tiny policy (built from its config, tokenizer trained on the embedded task) in a module's folder."""
    from yatt_apps.config import ModelSpec
    from yatt_apps.io.data import arithmetic_task
    from yatt_apps.io.models import prepare_model, tokenizer_corpus

    out = tmp_path_factory.mktemp("models") / "policy"
    return prepare_model(ModelSpec(), out, tokenizer_corpus(arithmetic_task(64)))


@pytest.fixture(scope="module")
def yatt_cli(ray_session):
    """`yatt ARGV --json` run in this process on the module's Ray session (`run_job` leaves a Ray it did not
    start running): the same command as a user's, without a fresh interpreter's imports and Ray start. Returns
    the summary the command printed last; a non-zero exit fails with what it wrote to stderr. What the last
    command wrote to stderr stays in `yatt_cli.stderr`."""
    import contextlib
    import io

    from yatt_apps.cli.main import main

    def run(*argv: str) -> dict:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*argv, "--json"])
        run.stderr = err.getvalue()
        assert code == 0, run.stderr[-3000:]
        return json.loads(out.getvalue().strip().splitlines()[-1])

    run.stderr = ""

    return run
