"""The run directory keeps config, metrics (JSONL and TensorBoard) and draws the summary plot."""

import json

import msgspec
from yatt_apps.rundir import RunDir


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
    run.log(2, {"reward/mean": 0.25})  # a resumed run re-logs step 2: the last entry wins in history()
    png = run.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[1] == {
        "step": 1,
        "reward/mean": 0.1,
        "train/kl": 0.01,
        "time/rollout": 1.0,
        "time/train": 0.5,
    }
    assert [row["reward/mean"] for row in run.history()] == [0.0, 0.1, 0.25]
    assert (tmp_path / "run" / "config.yaml").read_text() == "lr: 2.0e-06\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward/mean")] == [
        0.0,
        0.10000000149011612,
        0.20000000298023224,
        0.25,
    ]
