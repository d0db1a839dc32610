"""Nothing lost on a bad start (issue 33): a new job never writes into an existing run's folder, every check that
needs no model runs before the folder is touched, a failed start leaves no folder behind, `yatt resume` with
bad data or only broken checkpoints changes nothing; and the learners' rendezvous store listens on 127.0.0.1
in a one-node cluster. No Ray is started here: each refusal comes before it."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from yatt_apps.cli.main import build_parser, load_config, main
from yatt_apps.io.rundir import clear_run, holds_run
from yatt_apps.overlay import to_yaml
from yatt_apps.runtime.progress import yatt_command


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (what "unchanged" is checked against)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _bad_data(tmp_path: Path) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n')
    return data


def _old_run(tmp_path: Path, *sets: str) -> Path:
    """A run folder as a job leaves it: its resolved config, two logged steps, a checkpoint and a user's file."""
    run = tmp_path / "old"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / "learner-0.0.bin").write_bytes(b"weights")
    cfg, _ = load_config(build_parser().parse_args(["grpo", *sets]))
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (0, 1))
    )
    (run / "notes.txt").write_text("mine")
    return run


def _refusal(run: Path) -> str:
    return (
        f"yatt grpo: error: {run.resolve()} already holds a run: continue it with `{yatt_command()} resume {run.resolve()}`, "
        "or add --overwrite to delete its records and checkpoints and start over there\n"
    )


def test_a_new_job_in_an_existing_run_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    run = _old_run(tmp_path)
    before = _snapshot(run)
    assert main(["grpo", "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err == _refusal(run)
    # with bad data too: the refusal (no file read) comes first; --overwrite still checks the data before it
    # deletes anything
    data = _bad_data(tmp_path)
    assert main(["grpo", "--run-dir", str(run), "--set", f"data.train={data}"]) == 2
    assert capsys.readouterr().err == _refusal(run)
    assert main(["grpo", "--run-dir", str(run), "--overwrite", "--set", f"data.train={data}"]) == 2
    assert capsys.readouterr().err == f"yatt grpo: error: {data}:2: missing field 'answer'\n"
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "marker", ["config.yaml", "metrics.jsonl", "checkpoints/step-00000000/manifest.json"]
)
def test_any_record_of_a_run_makes_a_folder_a_run(tmp_path, marker):
    (tmp_path / "checkpoints").mkdir()  # empty, as a start that failed before its first checkpoint left it
    (tmp_path / "notes.txt").write_text("")
    assert not holds_run(tmp_path)
    (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / marker).write_text("")
    assert holds_run(tmp_path)


def test_resume_with_bad_data_exits_2_and_leaves_the_run_byte_identical(tmp_path, capsys):
    data = _bad_data(tmp_path)
    run = _old_run(tmp_path, "--set", f"data.train={data}")
    (run / "checkpoints" / "step-00000001").rename(run / "checkpoints" / ".staging-step-00000001")  # none yet
    before = _snapshot(run)
    assert main(["resume", str(run)]) == 2
    assert capsys.readouterr().err == f"yatt resume: error: {data}:2: missing field 'answer'\n"
    assert _snapshot(run) == before  # metrics.jsonl not truncated, config.yaml not rewritten


def test_resume_with_only_broken_checkpoints_is_refused_and_changes_nothing(tmp_path, capsys):
    run = _old_run(tmp_path)  # its one checkpoint has no manifest
    before = _snapshot(run)
    assert main(["resume", str(run)]) == 2
    ckpts = run.resolve() / "checkpoints"
    assert capsys.readouterr().err == (
        f"yatt resume: error: {ckpts}: no checkpoint verifies against its manifest, so the run cannot resume "
        f"(nothing was changed):\n  {ckpts}/step-00000001: no manifest.json, the checkpoint is incomplete\n"
        "restore them, or move them away to start the run over\n"
    )
    assert _snapshot(run) == before


def test_a_failed_start_leaves_no_folder_behind(tmp_path, capsys):
    data = _bad_data(tmp_path)
    assert main(["grpo", "--run-dir", str(tmp_path / "new"), "--set", f"data.train={data}"]) == 2
    assert capsys.readouterr().err == f"yatt grpo: error: {data}:2: missing field 'answer'\n"
    assert not (tmp_path / "new").exists()


def test_an_overlong_prompt_found_after_the_tiny_models_are_built_removes_the_new_folder(tmp_path, capsys):
    """A tiny model's tokenizer is trained on the data, so its lengths are checked once it is built (into the
    new folder): the folder goes again. No warm start: seconds, not minutes."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "%s", "answer": "3"}\n' % ("7 + " * 40))
    argv = ["grpo", "--run-dir", str(tmp_path / "new"), "--set", f"data.train={data}"]
    argv += ["--set", "data.max_prompt_tokens=40", "--set", "model.warm_start_steps=0"]
    argv += ["--set", "judge.warm_start_steps=0"]
    assert main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the model builds' own output
    head = ("7 + " * 15)[:60]
    assert (
        last
        == f"yatt grpo: error: {data}:2: prompt has 137 tokens, more than data.max_prompt_tokens=40: {head!r}"
    )
    assert not (tmp_path / "new").exists()


def test_overwrite_deletes_the_runs_own_files_only(tmp_path):
    run = _old_run(tmp_path)
    for name in (
        "tb/events",
        "models/policy/config.json",
        "models/mine/x",
        "final/config.json",
        "summary.png",
    ):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    deleted = clear_run(run)
    assert deleted == [
        "config.yaml",
        "metrics.jsonl",
        "tb",
        "checkpoints",
        "final",
        "summary.png",
        "models/policy",
    ]
    assert _snapshot(run) == {"models/mine/x": b"x", "notes.txt": b"mine"}
    assert not holds_run(run)


# ---- local by default: the learners' rendezvous store --------------------------------------------------------


def test_the_rendezvous_host_is_loopback_on_one_node_else_the_nodes_address():
    from yatt_apps.runtime.workers import store_host

    assert store_host(["192.0.2.2"], "192.0.2.2") == "127.0.0.1"
    assert store_host([], "192.0.2.2") == "127.0.0.1"
    assert store_host(["192.0.2.2", "192.0.2.3"], "192.0.2.2") == "192.0.2.2"


def test_the_rendezvous_store_listens_on_the_given_host_only():
    """torch's TCPStore alone listens on every interface (`*:PORT`); `listen_store` hands it a socket bound to
    the host, and a client rank still meets it there."""
    import psutil
    import torch.distributed as dist
    from yatt_controller.weight_sync import listen_store

    timeout = datetime.timedelta(seconds=30)
    store = listen_store("127.0.0.1", 2, timeout)
    listening = {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.laddr.port == store.port}
    assert listening == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timeout)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"


def test_a_full_disk_stops_with_one_line_naming_the_run_folder(tmp_path, capsys, monkeypatch):
    """A write that fails on a full disk (TensorBoard's writer names no file) ends the job with exit 1 and one
    line naming the run folder and what to do: no traceback, no second error from the cleanup."""
    import errno

    import yatt_apps.runtime.launch

    def full_disk(cfg, run_dir, job, existing):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(yatt_apps.runtime.launch, "run_job", full_disk)
    assert main(["grpo", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"yatt grpo: error: No space left on device: {(tmp_path / 'run').resolve()} (free space on that disk, "
        "then `yatt resume` the run folder, or start over elsewhere)\n"
    )


def test_a_read_only_path_is_named_with_its_cause(capsys, monkeypatch):
    import errno

    import yatt_apps.runtime.launch

    def read_only(cfg, run_dir, job, existing):
        raise OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run/config.yaml")

    monkeypatch.setattr(yatt_apps.runtime.launch, "run_job", read_only)
    assert main(["grpo", "--run-dir", "/mnt/ro/run"]) == 1
    assert capsys.readouterr().err == (
        "yatt grpo: error: Read-only file system: /mnt/ro/run/config.yaml (the disk is read-only: give --run-dir "
        "on a writable disk)\n"
    )


def test_closing_after_a_failure_keeps_the_first_error_and_removes_staging_folders(tmp_path):
    from yatt_apps.io.rundir import RunDir
    from yatt_apps.runtime.launch import close_all

    run = RunDir(tmp_path / "run", resume_step=-1)
    (run.checkpoints / ".staging-step-00000003").mkdir(parents=True)
    (run.checkpoints / "step-00000001").mkdir()
    calls = []

    def failing():
        calls.append("failing")
        raise OSError(28, "No space left on device")

    assert close_all([failing, lambda: calls.append("next") or "plot"], run, quiet=True) == "plot"
    assert calls == ["failing", "next"]  # a closer's error does not stop the others
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-00000001"]
    with pytest.raises(OSError, match="No space left"):  # after a good run, a cleanup error is the error
        close_all([failing], run, quiet=False)
