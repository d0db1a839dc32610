"""The run directory keeps config, metrics (JSONL, TensorBoard, W&B offline) and draws the summary plot; a
resumed run's records hold every step once."""

import json
import time
from pathlib import Path

import msgspec
import pytest
from yatt_apps.io.rundir import RunDir, last_step, read_metrics


class Cfg(msgspec.Struct, kw_only=True, frozen=True):
    lr: float = 1e-6


def test_metrics_tensorboard_and_plot(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_config(Cfg(lr=2e-6))
    for step in range(3):
        run.log(
            step,
            {
                "reward/mean": 0.1 * step,
                "train/kl": 0.01,
                "time/rollout": 1.0,
                "time/train": 0.5,
                "bad": float("nan"),
            },
        )
    run.log(2, {"reward/mean": 0.25})  # a restart re-logs step 2: it replaces the first record
    png = run.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (
        len(lines) == 3
        and lines[2] == {"step": 2, "reward/mean": 0.25}
        and lines[1]
        == {
            "step": 1,
            "reward/mean": 0.1,
            "train/kl": 0.01,
            "time/rollout": 1.0,
            "time/train": 0.5,
        }
    )
    assert [row["reward/mean"] for row in run.history()] == [0.0, 0.1, 0.25]
    assert (tmp_path / "run" / "config.yaml").read_text() == "lr: 2.0e-06\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [
        (0, 0.0),
        (1, 0.10000000149011612),
        (2, 0.25),
    ]


def _scalars(tb: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_rewind_in_the_writers_first_second_is_read_after_it(tmp_path):
    """TensorBoard reads a folder's event files in name order: the writer's creation second, then a counter
    of the process's writers, where ".10" sorts before ".9". A step logged again in the second the run's
    writer opened (its files ".9" and ".10") still reads as one value per step, the later one."""
    from tensorboard.summary.writer import event_file_writer

    while event_file_writer._global_uid.get() % 10 != 8:  # the run's writer gets ".9", its rewind ".10"
        pass
    run = RunDir(tmp_path)
    run.log(0, {"reward/mean": 0.0})
    run.log(1, {"reward/mean": 1.0})
    run.log(1, {"reward/mean": 5.0})  # a restart re-logs step 1
    run.close(plot=False)
    assert _scalars(tmp_path / "tb", "reward/mean") == [(0, 0.0), (1, 5.0)]


def test_resume_truncates_to_the_checkpoint_step(tmp_path):
    """A run killed after step 24 with its newest checkpoint at step 19: the resumed run's RunDir keeps steps
    0..19, and the resumed steps 20..29 are appended once each, in JSONL and in TensorBoard's view."""
    run = RunDir(tmp_path)
    for step in range(25):
        run.log(step, {"reward/mean": float(step)})
    run.close(plot=False)
    run = RunDir(tmp_path, resume_step=19)
    assert [row["step"] for row in read_metrics(tmp_path)] == list(range(20))
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    for step in range(20, 30):
        run.log(step, {"reward/mean": 100.0 + step})
    run.close(plot=False)
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == list(range(30))
    assert [row["reward/mean"] for row in rows] == [float(s) for s in range(20)] + [
        100.0 + s for s in range(20, 30)
    ]
    assert last_step(tmp_path) == 29
    assert _scalars(tmp_path / "tb", "reward/mean") == [(s, r["reward/mean"]) for s, r in enumerate(rows)]


def test_a_torn_last_line_is_dropped_before_appending(tmp_path):
    """A writer killed mid-line: the next RunDir drops the fragment, so the next row starts a line."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1.0}\n{"step": 1, "a"')
    run = RunDir(tmp_path, tensorboard=False)
    run.log(1, {"a": 2.0})
    run.close(plot=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "a": 1.0}\n{"step": 1, "a": 2.0}\n'


def test_resume_from_scratch_and_torn_last_line(tmp_path):
    """resume_step=-1 (no checkpoint yet) drops every record; a line torn by a kill is not a step."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1.0}\n{"step": 1, "a": 2.0}\n{"step": 2, "a"')
    assert last_step(tmp_path) == 1
    run = RunDir(tmp_path, tensorboard=False, resume_step=-1)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    run.log(0, {"a": 5.0})
    run.close(plot=False)
    assert read_metrics(tmp_path) == [{"step": 0, "a": 5.0}]


def test_wandb_offline_has_the_metric_names_of_metrics_jsonl(tmp_path, monkeypatch, wandb_records):
    """log.wandb=true: the W&B run is written offline under RUN_DIR/wandb, and its logged keys are exactly
    the keys of metrics.jsonl (besides W&B's own underscore-prefixed keys)."""
    pytest.importorskip("wandb")
    from yatt_apps.config import LogSpec, RunConfig

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = RunConfig(log=LogSpec(wandb=True, project="yatt-test", run_name="offline-check"))
    run = RunDir(tmp_path / "run", tensorboard=False)
    run.write_config(cfg)
    for step in range(3):
        run.log(
            step, {"reward/mean": 0.5 * step, "train/kl": 0.01, "time/step": 1.5, "skipped": float("inf")}
        )
    run.close(plot=False)
    offline = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    deadline = time.monotonic() + 60  # finish() returns before W&B's service process has written everything
    while "exit" not in wandb_records.types(offline[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    logged = wandb_records.history(offline[0])
    assert [row["_step"] for row in logged] == [0, 1, 2]
    jsonl = read_metrics(tmp_path / "run")
    for row, want in zip(logged, jsonl, strict=True):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == {
            k: v for k, v in want.items() if k != "step"
        }
    (run_record,) = [
        rec.run for rec in wandb_records.read(offline[0]) if rec.WhichOneof("record_type") == "run"
    ]
    assert run_record.display_name == "offline-check" and run_record.project == "yatt-test"
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["log"] == {"wandb": True, "project": "yatt-test", "run_name": "offline-check"}


def _wandb_records(run: Path):
    """The records of an offline W&B run's .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing (32 KiB blocks of chunks: crc32, little-endian length, type 1 full / 2 first /
    3 middle / 4 last; a block tail under 7 bytes is padding), each record a protobuf `Record`."""
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
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""
        elif kind == 0:
            chunk = b""


def test_summary_panels_show_accuracy_agreement_and_each_reward_term():
    from yatt_apps.io.rundir import plot_panels

    history = [
        {
            "step": 0,
            "val/accuracy": 0.39,
            "judge/agreement": 1.0,
            "reward/mean": 0.4,
            "reward/genrm_mean": 0.3,
        },
        {"step": 1, "judge/agreement": 1.0, "reward/mean": 0.5, "reward/genrm_mean": 0.35},
        {
            "step": 2,
            "val/accuracy": 0.66,
            "judge/agreement": 1.0,
            "reward/mean": 0.6,
            "reward/math_verify_mean": 0.2,
        },
    ]
    panels = dict(plot_panels(history))
    # no KL or response length logged: those panels are left out; a constant series says so in its title
    assert list(panels) == [
        "validation accuracy",
        "judge agreement with the rule (constant 1)",
        "reward per term",
    ]
    assert panels["validation accuracy"] == {"val/accuracy": [(0, 0.39), (2, 0.66)]}  # evaluated steps only
    assert panels["reward per term"] == {
        "reward/genrm_mean": [(0, 0.3), (1, 0.35)],
        "reward/math_verify_mean": [(2, 0.2)],
        "reward/mean": [(0, 0.4), (1, 0.5), (2, 0.6)],
    }


def test_summary_stacks_phase_times_only_and_draws_streaming_apart(tmp_path):
    """A 0/1 flag and the busy times inside rollout_reward are not stacked as phase seconds; the streaming
    figures get their own panel; the PNG is written."""
    from yatt_apps.io.rundir import phase_keys, plot_panels, plot_summary

    row = {
        "step": 0,
        "reward/mean": 0.5,
        "time/rollout_reward": 2.0,
        "time/train": 1.0,
        "time/step": 3.5,
        "time/startup": 20.0,
        "time/rollout_s": 1.5,
        "time/reward_s": 1.2,
        "time/rollout_reward_overlap_s": 0.7,
        "time/judge_started_before_rollout_end": 1.0,
    }
    history = [row, {**row, "step": 1, "time/train": 1.5}]
    assert phase_keys(history) == ["time/rollout_reward", "time/train"]
    panels = dict(plot_panels(history))
    assert sorted(panels["rollout and reward streaming (s)"]) == [
        "time/reward_s",
        "time/rollout_reward_overlap_s",
        "time/rollout_s",
    ]
    out = plot_summary(history, tmp_path / "summary.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
