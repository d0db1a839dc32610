"""The driver's per-step callback: metrics into the run directory, and a progress bar with seconds per step
and an ETA.

Metrics per step (the lead controller's report): its own metrics, `time/<phase>` for each phase and
`time/step`, `time/idle` (the step's time outside its phases: waiting on other controllers or workers) and
`throughput/tokens_per_s`. The first step of a run (or of a resumed attempt) also pays for start-up: Ray,
placement, worker processes loading models, the first calls. That wait is reported once as `time/startup`
(from the run's start, when the caller gives it, to the first step's start, plus the first step's idle time,
which is workers still starting) and the first step's `time/idle` is 0, so start-up never reads as idle time
of a training step, and the bar's seconds per step and ETA leave it out.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from yatt_apps.io.rundir import RunDir


def yatt_command() -> str:
    """How the user runs `yatt`, for commands printed in messages that they paste: `uv run yatt` when this
    process was started by `uv run` (the README's install puts `yatt` in the project's environment, not on the
    shell's PATH), else `yatt`."""
    import os

    return "uv run yatt" if os.environ.get("UV_RUN_RECURSION_DEPTH") else "yatt"


RATE_WINDOW = 10  # steps the bar's seconds per step averages over


def quiet_transformers() -> None:
    """Turn off transformers' (and huggingface_hub's) progress bars ("Loading weights", "Writing model shards")
    and its info/warning log lines in this process, so a run's console shows one bar, the run's. The switch is
    transformers' own per-process setting: the driver calls this when it starts logging steps (`StepLogger`)
    and before a warm start (`warmstart.cached_or_build`); hosted workers' output does not reach the console
    (Ray starts with `log_to_driver=False`) and goes to Ray's log files."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class StepLogger:
    """`on_step(step, reports)` for yatt_controller's Job. `started_at`: `time.perf_counter()` when the run
    started (None: start-up counts from the first step's start only)."""

    def __init__(
        self, run: RunDir, num_steps: int, start_step: int, progress: bool, started_at: float | None = None
    ) -> None:
        self.run = run
        self.last: dict[str, Any] = {}
        self.num_steps, self.started_at, self.start_step = num_steps, started_at, start_step
        self.first = True
        self.durations: deque[float] = deque(maxlen=RATE_WINDOW)  # seconds of recent steps, start-up excluded
        self.previous: float | None = None  # perf_counter when the previous step's report arrived
        self.bar = None
        quiet_transformers()  # the driver's model loads and saves that follow (export of final/) print no bars
        if progress:
            from tqdm import tqdm

            # tqdm's own rate and remaining time would count start-up as a step: the postfix carries ours
            bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
            self.bar = tqdm(
                total=num_steps,
                initial=start_step,
                desc="yatt",
                unit="step",
                dynamic_ncols=True,
                bar_format=bar_format,
            )

    def metrics(self, reports: list[Any], now: float, first: bool) -> tuple[dict[str, float], float]:
        """(one step's metrics from the controllers' reports (the lead's), the step's seconds without
        start-up), start-up split off when it is the attempt's `first` step."""
        lead = reports[0]
        timings = {f"time/{k}": v for k, v in lead.timings_s.items()}
        phases = sum(v for k, v in lead.timings_s.items() if k != "step")
        step_s = lead.timings_s.get("step", phases)
        idle = max(step_s - phases, 0.0)
        metrics = {**lead.metrics, **timings, "time/idle": idle}
        busy = step_s
        if first:
            before = 0.0 if self.started_at is None else max(now - step_s - self.started_at, 0.0)
            metrics["time/startup"], metrics["time/idle"], busy = before + idle, 0.0, step_s - idle
        metrics["throughput/tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / max(busy, 1e-9)
        if "placement/reward_devices" in metrics:  # live placement: the judge is the reward service
            metrics["placement/judge_devices"] = metrics["placement/reward_devices"]
        return metrics, busy

    def __call__(self, step: int, reports: list[Any]) -> None:
        if step < self.start_step:  # a report the checkpoint carried: logged now only if the log lacks it
            if self.run.last_step is None or step > self.run.last_step:
                self.run.log(step, self.metrics(reports, time.perf_counter(), first=False)[0])
            return
        now = time.perf_counter()
        metrics, busy = self.metrics(reports, now, self.first)
        # after the first step, the wall time between reports (checkpoints and driver overhead included)
        self.durations.append(busy if self.previous is None else now - self.previous)
        self.previous, self.first = now, False
        self.run.log(step, metrics)
        self.last = {"step": step, **metrics}
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(self.postfix(step, metrics), refresh=False)

    def seconds_per_step(self) -> float:
        return sum(self.durations) / len(self.durations) if self.durations else 0.0

    def eta_s(self, step: int) -> float:
        """Seconds left: the remaining steps at the recent seconds per step."""
        return max(self.num_steps - 1 - step, 0) * self.seconds_per_step()

    def postfix(self, step: int, metrics: dict[str, float]) -> str:
        """The bar's text after the elapsed time; tqdm puts the ", " before it (`{postfix}` in the format)."""
        return (
            f"{self.seconds_per_step():.2f}s/step, ETA {_clock(self.eta_s(step))}, "
            f"reward={metrics.get('reward/mean', 0.0):.3f}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
