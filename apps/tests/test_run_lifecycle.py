"""Around a real run (tiny preset, real Ray, `yatt` in a fresh process, as a user runs it): export of its
checkpoints as HF folders and their merge, the W&B offline files, resume of a finished run, Ctrl-C, and
kill -9 followed by `yatt resume`, after which every step appears once in metrics.jsonl; a new job refused in
the run's folder, and resume past corrupt checkpoints (named) or refused when none is valid.

Each job gets its own Ray temp dir (RAY_TMPDIR), so its Ray processes can be told from other sessions'.
Marked slow: every run starts Ray and the tiny models' host processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from yatt_apps.runtime import local_ray
from yatt_apps.runtime.progress import yatt_command

pytestmark = pytest.mark.slow

# one device, one controller: what these tests check (export, W&B, resume, signals, the reaper) does not depend
# on the number of hosts, and each host costs a process's start (torch and transformers imported) in every run
ONE_DEVICE = ["--set", "placement.cluster.devices_per_node=1", "--set", "controller.num_controllers=1"]
SHORT = ["--set", "run.eval_every=0", "--set", "run.prompts_per_step=4", "--set", "sampling.n=4", *ONE_DEVICE]


def _env(ray_tmp: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": ray_tmp, "WANDB_SILENT": "true", **extra}


def _ray_tmp() -> str:
    return tempfile.mkdtemp(prefix="yr", dir="/tmp")  # short: Ray's socket paths live under it


def _yatt(*argv: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "yatt_apps.cli", *argv], env=env, capture_output=True, text=True, timeout=1200
    )
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _ray_processes(ray_tmp: str) -> list[str]:
    """Live processes started for a Ray session under `ray_tmp` (their command lines name it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if ray_tmp in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def _no_ray_left(ray_tmp: str, within_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := _ray_processes(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _kill_leftovers(ray_tmp: str) -> None:
    """After a kill -9 the run's Ray processes are orphans of this test: end them by pid."""
    for line in _ray_processes(ray_tmp):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`yatt ARGV` in the background, in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "yatt_apps.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if (run_dir / "metrics.jsonl").exists() and step in _steps(run_dir):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not logged within {timeout_s} s")


# ---- a finished 2-step run: export, merge, W&B, resume ---------------------------------------------------


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("life") / "run"
    ray_tmp = _ray_tmp()
    env = _env(ray_tmp, WANDB_MODE="offline")
    _yatt(
        "grpo",
        "--run-dir",
        str(run_dir),
        *SHORT,
        "--set",
        "run.num_steps=2",
        "--set",
        "controller.checkpoint_every=1",
        "--set",
        "log.wandb=true",
        "--json",
        env=env,
    )
    assert _no_ray_left(ray_tmp) == []
    return run_dir


@pytest.fixture(scope="module")
def exported(two_step_run) -> dict[int, Path]:
    from yatt_apps.cli.main import main

    out = {}
    for step in (0, 1):
        out[step] = two_step_run.parent / f"export-{step}"
        assert (
            main(["export", str(two_step_run), "--step", str(step), "--out", str(out[step]), "--json"]) == 0
        )
    return out


def _learner_reference(run_dir: Path, step: int):
    """The learner's policy at `step`, straight from the checkpoint's sharded learner files: the initial model
    with the checkpoint's model tensors loaded."""
    from yatt_algos.learner.sharded import iter_checkpoint_tensors
    from yatt_apps.io.models import load_causal_lm

    shards = run_dir / "checkpoints" / f"step-{step:08d}" / "learner"
    model = load_causal_lm(run_dir / "models" / "policy")
    model.load_state_dict({k: v for bucket in iter_checkpoint_tensors(shards) for k, v in bucket})
    return model.eval()


def _greedy(model, ids) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_exported_steps_load_differ_and_match_the_learner(two_step_run, exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models = {
        s: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for s, p in exported.items()
    }
    first, second = (dict(models[s].named_parameters()) for s in (0, 1))
    assert any(not torch.equal(first[k], second[k]) for k in first)  # step 1's update moved the weights
    tok = AutoTokenizer.from_pretrained(exported[1])
    assert tok.chat_template  # the chat template travels with the model
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "3 + 4 ="}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    reference = _learner_reference(two_step_run, 1)
    assert _greedy(models[1], ids) == _greedy(reference, ids)
    with torch.no_grad():
        torch.testing.assert_close(models[1](ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_merge_of_two_exported_folders(exported, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from yatt_apps.jobs.merge import merge_directories

    record = merge_directories(
        [exported[0], exported[1]], tmp_path / "merged", beta=0.7, preference=[0.5, 0.5]
    )
    assert record["lambda"] == pytest.approx([0.5, 0.5])
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    a, b = (load_file(exported[s] / "model.safetensors") for s in (0, 1))
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, 0.5 * a[name] + 0.5 * b[name])
    AutoModelForCausalLM.from_pretrained(tmp_path / "merged")


def test_final_folder_equals_the_last_checkpoint(two_step_run, exported):
    """The run's own RUN_DIR/final (written from the live learner at the end) holds step 1's weights."""
    from safetensors.torch import load_file

    if not (two_step_run / "final").exists():
        pytest.skip("this checkout's launch does not write RUN_DIR/final yet")
    final = load_file(two_step_run / "final" / "model.safetensors")
    assert final.keys() == load_file(exported[1] / "model.safetensors").keys()
    for name, tensor in load_file(exported[1] / "model.safetensors").items():
        assert (final[name] == tensor).all(), name


def test_wandb_offline_run_has_the_metric_names(two_step_run, wandb_records):
    (offline,) = (two_step_run / "wandb").glob("offline-run-*")
    logged = wandb_records.history(offline)
    rows = [json.loads(line) for line in (two_step_run / "metrics.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in logged] == [row["step"] for row in rows] == [0, 1]
    for got, want in zip(logged, rows, strict=True):
        assert {k for k in got if not k.startswith("_")} == set(want) - {"step"}
        assert got["reward/mean"] == pytest.approx(want["reward/mean"])


def test_resume_of_the_finished_run_starts_nothing(two_step_run):
    ray_tmp = _ray_tmp()
    out = _yatt("resume", str(two_step_run), env=_env(ray_tmp))
    assert f"run {two_step_run} is finished: its last step (1) is done" in out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["finished"] is True
    assert "Ray" not in out.stderr and not any(Path(ray_tmp).iterdir())  # Ray never started


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_job_in_the_runs_folder_is_refused_and_changes_nothing(two_step_run, capsys):
    from yatt_apps.cli.main import main

    before = _files(two_step_run)
    assert main(["grpo", "--run-dir", str(two_step_run), *SHORT]) == 2
    assert capsys.readouterr().err == (
        f"yatt grpo: error: {two_step_run} already holds a run: continue it with `{yatt_command()} resume {two_step_run}`, "
        "or add --overwrite to delete its records and checkpoints and start over there\n"
    )
    assert _files(two_step_run) == before


def _corrupt(ckpt: Path) -> None:
    blob = ckpt / "learner" / "extra-0.pt"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 tells
    blob.write_bytes(bytes(data))


def test_resume_names_a_corrupt_checkpoint_and_refuses_when_none_is_valid(two_step_run, tmp_path, capsys):
    """Both checkpoints of the finished run broken: `yatt resume` to step 3 exits 2 naming each, and the run's
    files (metrics.jsonl above all) stay as they were. (Only the newest broken, a resume continues from the
    older one, saying which it skipped: the last resume of the kill -9 test below.)"""
    import shutil

    from yatt_apps.cli.main import main

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    ckpts = run / "checkpoints"
    for step in (0, 1):
        _corrupt(ckpts / f"step-{step:08d}")
    before = _files(run)
    assert main(["resume", str(run), "--set", "run.num_steps=3", "--set", "log.wandb=false"]) == 2
    why = "learner/extra-0.pt does not match its manifest entry (size or sha256)"
    assert capsys.readouterr().err == (
        f"yatt resume: error: {ckpts}: no checkpoint verifies against its manifest, so the run cannot resume "
        f"(nothing was changed):\n  {ckpts}/step-00000001: {why}\n  {ckpts}/step-00000000: {why}\n"
        "restore them, or move them away to start the run over\n"
    )
    assert _files(run) == before


# ---- Ctrl-C, kill -9, resume -----------------------------------------------------------------------------


def _still_running(tree: dict[int, int]) -> list[str]:
    """The processes of `tree` ({pid: start time}) that are still the same live, non-zombie process."""
    return [f"{pid}: {_comm(pid)}" for pid, started in tree.items() if local_ray.alive(pid, started)]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def _listening(pids: set[int]) -> list[str]:
    """host:port of every listening TCP socket of these processes."""
    import psutil

    return sorted(
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    )


# The run is started for more steps than the stops leave it time for, however fast the steps get (at 16, a
# resumed run once logged its last step before its Ctrl-C arrived); the last resume shortens it with
# `--set run.num_steps=N` (what a user does to change a run's length) to a few steps past its checkpoint.
STEPS = 400


def test_kill_9_then_ctrl_c_then_resume_log_every_step_once(tmp_path, yatt_cli):
    """One run, stopped twice and resumed twice (`yatt` in a fresh process with its own Ray for the two
    that are stopped; the last resume in this process, on the test process's Ray session):
    1. kill -9 of the driver alone once step 2 is logged (what a crash or the OOM killer does): the job's Ray
       listened on the loopback interface only, and no process of the driver's tree is left (its reaper ends
       the agents Ray does not fate-share);
    2. `yatt resume`, then SIGINT to its process group (what a terminal's Ctrl-C does) two steps later: exit
       130, the resume hint with the last logged step and the checkpoint it continues from, no traceback, no
       Ray process left;
    3. its newest checkpoint broken, `yatt resume --set run.num_steps=N` to the end (N a few steps past the
       last one logged): it skips that checkpoint naming it, continues from the one before, and steps 0..N-1
       are logged once each (each resume redoes the steps after its checkpoint)."""
    from yatt_controller import checkpoint

    run_dir, ray_tmp = tmp_path / "run", _ray_tmp()
    sets = ["--set", f"run.num_steps={STEPS}", "--set", "controller.checkpoint_every=2"]
    proc = _start(["grpo", "--run-dir", str(run_dir), *SHORT, *sets], _env(ray_tmp))
    try:
        _wait_for_step(proc, run_dir, 2)  # the run is still going, Ray and its agents are up
        # every process the driver started, by pid and start time (Ray's agents rename themselves, so their
        # command lines do not name the Ray temp dir)
        tree = local_ray.descendants([proc.pid])
        assert "raylet" in {_comm(pid) for pid in tree}
        sockets = _listening({proc.pid, *tree})
        loopback = ("127.0.0.1", "::ffff:127.0.0.1")
        assert sockets and all(s.rsplit(":", 1)[0] in loopback for s in sockets), sockets
        os.kill(proc.pid, signal.SIGKILL)  # the driver only
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 20
        while (left := _still_running(tree)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], left
        assert _no_ray_left(ray_tmp, within_s=5) == []
    finally:
        _kill_leftovers(ray_tmp)
    killed = _steps(run_dir)
    assert killed == list(range(len(killed))) and len(killed) >= 3

    ray_tmp = _ray_tmp()
    proc = _start(["resume", str(run_dir)], _env(ray_tmp))
    _wait_for_step(proc, run_dir, killed[-1] + 2)
    os.killpg(proc.pid, signal.SIGINT)  # controllers run ahead of the driver's log: STEPS leave room
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    logged = _steps(run_dir)
    assert (
        logged == list(range(len(logged))) and len(killed) + 2 <= len(logged) < STEPS
    )  # stopped before the end
    found = checkpoint.latest(run_dir / "checkpoints")
    # controllers run ahead of the driver's log: the checkpoint may hold steps not logged yet (it carries
    # their reports, and the resumed run logs them first)
    assert found is not None and found[1].step < STEPS
    assert err.endswith(
        f"interrupted at step {logged[-1]}; resume with: {yatt_command()} resume {run_dir}\n"
        f"(the run continues after the checkpoint of step {found[1].step})\n"
    ), err[-3000:]
    assert "yatt: stopping (Ctrl-C again to exit at once)" in err
    assert "Traceback" not in err, err[-3000:]
    assert _no_ray_left(ray_tmp) == []

    # the newest checkpoint broken (one flipped byte): the last resume continues from the one before it,
    # saying which it skipped, and still logs each step once
    _corrupt(found[0])
    end = max(logged[-1], found[1].step) + 3
    assert yatt_cli("resume", str(run_dir), "--set", f"run.num_steps={end}")["step"] == end - 1
    why = "learner/extra-0.pt does not match its manifest entry (size or sha256)"
    assert f"skipped checkpoint {found[0]}: {why}\n" in yatt_cli.stderr, yatt_cli.stderr[-3000:]
    assert _steps(run_dir) == list(range(end))
