"""The per-step logger: metrics into the run directory, start-up split off the first step, seconds per step
and ETA from the steps after it (hand-worked numbers; the clock is driven by the test)."""

from __future__ import annotations

import pytest
from yatt_apps.io.rundir import RunDir, read_metrics
from yatt_apps.runtime import progress
from yatt_apps.runtime.progress import StepLogger
from yatt_controller.types import StepReport


def _report(step: int, step_s: float, rollout: float, train: float) -> StepReport:
    return StepReport(
        step=step,
        controller_rank=0,
        metrics={"reward/mean": 0.1 * step, "rollout/response_tokens": 80.0},
        timings_s={"rollout": rollout, "train": train, "step": step_s},
    )


def test_startup_is_split_off_the_first_step(tmp_path, monkeypatch):
    clock = iter([110.0, 114.0, 117.0, 122.0])  # perf_counter when each step's reports arrive
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    run = RunDir(tmp_path, tensorboard=False)
    logger = StepLogger(run, num_steps=10, start_step=0, progress=False, started_at=50.0)
    # step 0 ran 40 s, of which 30 s idle (workers still loading): it started at 110 - 40 = 70, 20 s after
    # the run started, so start-up is 20 + 30 = 50 s and the step itself 10 s
    logger(0, [_report(0, 40.0, 6.0, 4.0)])
    row = read_metrics(tmp_path)[0]
    assert row["time/startup"] == 50.0 and row["time/idle"] == 0.0 and row["time/step"] == 40.0
    assert row["throughput/tokens_per_s"] == 8.0  # 80 tokens in the 10 busy seconds
    assert logger.seconds_per_step() == 10.0 and logger.eta_s(0) == 90.0
    logger(1, [_report(1, 3.5, 2.0, 1.0)])  # arrives 4 s after step 0's report
    row = read_metrics(tmp_path)[1]
    assert (
        "time/startup" not in row and row["time/idle"] == 0.5 and row["throughput/tokens_per_s"] == 80 / 3.5
    )
    assert logger.seconds_per_step() == 7.0 and logger.eta_s(1) == 56.0  # (10 + 4) / 2 x 8 steps left
    logger(2, [_report(2, 2.5, 2.0, 0.5)])  # 3 s later
    assert logger.seconds_per_step() == pytest.approx(17 / 3)
    assert logger.postfix(2, {"reward/mean": 0.2}) == "5.67s/step, ETA 00:40, reward=0.200"
    assert logger.last["step"] == 2 and logger.last["time/idle"] == 0.0
    run.close(plot=False)


def test_resumed_attempt_counts_startup_from_its_first_step(tmp_path, monkeypatch):
    """A resumed run's first step (here 7) carries the attempt's start-up; without started_at only the
    step's idle time counts."""
    monkeypatch.setattr(progress.time, "perf_counter", lambda: 1000.0)
    run = RunDir(tmp_path, tensorboard=False)
    logger = StepLogger(run, num_steps=9, start_step=7, progress=True)
    logger(7, [_report(7, 12.0, 1.0, 1.0)])
    logger.close()
    run.close(plot=False)
    (row,) = read_metrics(tmp_path)
    assert row["step"] == 7 and row["time/startup"] == 10.0 and row["time/idle"] == 0.0
    assert logger.bar.n == 8 and logger.eta_s(7) == 2.0  # one step left at 2 s
    assert progress._clock(3725) == "1:02:05"


def test_a_resumed_run_logs_the_carried_steps_its_log_lacks(tmp_path):
    """Resuming from the checkpoint of step 3 (start_step 4) after a driver died having logged steps 0..1:
    the checkpoint's carried reports of steps 1..3 reach the logger first; 2 and 3 are logged (once, as
    ordinary steps, no start-up), 1 is already there; then the run's own steps go on as usual."""
    first = RunDir(tmp_path, tensorboard=False)
    for step in (0, 1):
        first.log(step, {"reward/mean": 0.1 * step})
    first.close(plot=False)
    run = RunDir(tmp_path, tensorboard=False, resume_step=3)
    logger = StepLogger(run, num_steps=6, start_step=4, progress=False, started_at=0.0)
    for step in (1, 2, 3):
        logger(step, [_report(step, 2.0, 1.0, 1.0)])
    logger(4, [_report(4, 2.0, 1.0, 0.5)])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[1] == {"step": 1, "reward/mean": 0.1}  # kept from the first driver, not rewritten
    assert rows[2]["reward/mean"] == pytest.approx(0.2) and "time/startup" not in rows[2]
    assert "time/startup" in rows[4]  # the resumed attempt's first own step still carries its start-up


def test_the_bar_line_has_one_comma_before_the_rate(tmp_path, monkeypatch):
    """The rendered line of issue 34's double comma (`[00:37, , 0.46s/step, ...]`): tqdm writes ", " before
    the postfix itself. The last step of a resumed run: 0.46 s busy (no idle), nothing left, 37 s elapsed."""
    monkeypatch.setattr(progress.time, "perf_counter", lambda: 500.0)
    run = RunDir(tmp_path, tensorboard=False)
    logger = StepLogger(run, num_steps=10, start_step=9, progress=True)
    report = StepReport(
        step=9,
        controller_rank=0,
        metrics={"reward/mean": 0.078},
        timings_s={"rollout": 0.26, "train": 0.2, "step": 0.46},
    )
    logger(9, [report])
    assert logger.bar is not None
    # the line as tqdm renders it, at a fixed elapsed time and width, in unicode blocks whatever the terminal
    line = logger.bar.format_meter(**{**logger.bar.format_dict, "elapsed": 37, "ncols": None, "ascii": False})
    logger.close()
    run.close(plot=False)
    assert line == "yatt: 100%|██████████| 10/10 [00:37, 0.46s/step, ETA 00:00, reward=0.078]"
