"""A run directory: the resolved config, metrics as JSONL and TensorBoard events (and optionally W&B),
checkpoints, and a final plot.

Layout:
    RUN_DIR/config.yaml         the resolved config (what `yatt resume RUN_DIR` reloads)
    RUN_DIR/metrics.jsonl       one JSON object per step (appended, flushed, so a killed run keeps its history)
    RUN_DIR/tb/                 TensorBoard events of the same scalars
    RUN_DIR/wandb/              the W&B run's local files, with `log.wandb=true`
    RUN_DIR/checkpoints/        written by yatt_controller's atomic checkpointer: step-N/ (manifest.json last),
                                its learner/ the policy learner's sharded DCP files (.metadata, __R_0.distcp
                                and extra-R.pt per rank), controller-C.msgpack, other workers' <name>-D.T.bin
    RUN_DIR/final/              the trained policy as an HF folder, written when the run ends
    RUN_DIR/placement.jsonl     placement.mode=dynamic: the re-planner's decision after every step, and why
    RUN_DIR/summary.png         reward, KL, response length and phase times, drawn at the end
    RUN_DIR/models/policy, judge  tiny models built for the run (from its data: a tokenizer trained on it)

A folder that already holds a run (`holds_run`) is only written by `yatt resume`; a new job there is refused
unless `--overwrite`, which deletes the run's own files (`clear_run`: the layout above, nothing else).

Exact records: every step appears once. A resumed run (`resume_step`, the checkpoint it continues from)
drops the logged steps after that checkpoint (they are run again) from metrics.jsonl, rewritten atomically,
and from TensorBoard's view (`purge_step`); a step logged again within one process (a restart from a
checkpoint) rewinds the same way.
"""

from __future__ import annotations

import json
import math
import os
import time
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.overlay import to_yaml

# summary.png's panels: a title and the metrics it draws (fnmatch patterns: "*" matches any text)
PLOT_PANELS = {
    "validation accuracy": ["val/accuracy"],
    "judge agreement with the rule": ["judge/agreement"],
    "reward per term": ["reward/mean", "reward/*_mean"],
    "kl": ["train/kl"],
    "response length": ["rollout/response_len_mean"],
    # busy seconds inside the rollout_reward phase (they overlap: not stacked with the phases)
    "rollout and reward streaming (s)": ["time/rollout_s", "time/reward_s", "time/rollout_reward_overlap_s"],
}
TIMING_PREFIX = "time/"
# time/ figures that are not a part of the step's stacked phase time: totals, the streaming busy times above,
# and a 0/1 flag (whether judging started before the last completion was done)
NOT_PHASES = {
    "time/step",
    "time/startup",
    "time/rollout_s",
    "time/reward_s",
    "time/rollout_reward_overlap_s",
    "time/judge_started_before_rollout_end",
}
METRICS = "metrics.jsonl"
# what a run writes into its folder (clear_run deletes these and nothing else: a user's own files stay)
RUN_FILES = (
    "config.yaml",
    "config.yaml.tmp",
    METRICS,
    METRICS + ".tmp",
    "tb",
    "wandb",
    "checkpoints",
    "final",
    "final.tmp",
    "final.old",
    "placement.jsonl",
    "summary.png",
    "models/policy",
    "models/policy.tmp",
    "models/judge",
    "models/judge.tmp",
)


def holds_run(path: str | Path) -> bool:
    """Whether a folder holds a run: its config.yaml or metrics.jsonl, or a checkpoint."""
    path = Path(path)
    ckpts = path / "checkpoints"
    has_checkpoint = ckpts.is_dir() and any(ckpts.iterdir())
    return (path / "config.yaml").exists() or (path / METRICS).exists() or has_checkpoint


def clear_run(path: str | Path) -> list[str]:
    """Delete a run's own files from its folder (`RUN_FILES`); returns the names deleted."""
    import shutil

    deleted = []
    for name in RUN_FILES:
        target = Path(path) / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        else:
            continue
        deleted.append(name)
    return deleted


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a run directory's metrics.jsonl, in file order ([] when there is none); a torn last line
    (a killed writer) is skipped."""
    file = Path(path) / METRICS
    rows = []
    for line in file.read_text().splitlines() if file.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def last_step(path: str | Path) -> int | None:
    """The last step logged in a run directory's metrics.jsonl, or None."""
    rows = read_metrics(path)
    return int(rows[-1]["step"]) if rows else None


def truncate_metrics(path: str | Path, keep_through: float = math.inf) -> int:
    """Rewrite RUN_DIR/metrics.jsonl atomically with only the rows of steps <= `keep_through` (and without a
    torn last line, which the next append would otherwise run into); returns how many rows were dropped."""
    file = Path(path) / METRICS
    rows = read_metrics(path)
    kept = [row for row in rows if int(row["step"]) <= keep_through]
    torn = file.exists() and file.stat().st_size > 0 and not file.read_bytes().endswith(b"\n")
    if file.exists() and (len(kept) != len(rows) or torn):
        tmp = file.with_name(METRICS + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(file)
    return len(rows) - len(kept)


def _next_events_second(tb: Path) -> None:
    """TensorBoard reads a folder's event files in name order; a name starts with its writer's creation second
    and ends with a per-process counter, where ".10" sorts before ".9". A writer opened in the same second as
    an existing file (a rewind right after the start) waits for the next second, so its file, and its
    `purge_step`, are read after the earlier one's."""
    stamps = [p.name.split(".")[3] for p in tb.glob("events.out.tfevents.*")]
    newest = max((int(s) for s in stamps if s.isdigit()), default=-1)
    while int(time.time()) == newest:
        time.sleep(0.05)


class RunDir:
    """Owns one run's directory. `log` appends a step's scalars; `close` flushes and draws the plot.

    `resume_step`: None for a run that appends to whatever is there; a step k when the run continues from
    the checkpoint of step k (-1: from scratch), so the records of steps after k are dropped first."""

    def __init__(self, path: str | Path, *, tensorboard: bool = True, resume_step: int | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(exist_ok=True)
        truncate_metrics(self.path, math.inf if resume_step is None else resume_step)
        self._last = last_step(self.path)
        self._metrics = open(self.path / METRICS, "a")  # noqa: SIM115 (held for the run)
        self._tensorboard = tensorboard
        self._tb = self._tb_writer(None if resume_step is None else resume_step + 1)
        self._wandb = None

    @property
    def last_step(self) -> int | None:
        """The last step logged (this run's records, or those kept from before a resume)."""
        return self._last

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def _tb_writer(self, purge_step: int | None):
        """A TensorBoard writer; with `purge_step`, TensorBoard discards the events of steps >= purge_step
        written before (a resumed run's view starts again at its checkpoint)."""
        if not self._tensorboard:
            return None
        from torch.utils.tensorboard import SummaryWriter

        _next_events_second(self.path / "tb")
        return SummaryWriter(str(self.path / "tb"), purge_step=purge_step)

    def write_config(self, config: msgspec.Struct) -> None:
        """Write config.yaml; a config with `log.wandb` on also opens the W&B run, with it as the run's config."""
        tmp = self.path / "config.yaml.tmp"
        tmp.write_text(to_yaml(config))
        tmp.replace(self.path / "config.yaml")
        log = getattr(config, "log", None)
        if log is not None and log.wandb and self._wandb is None:
            self._wandb = open_wandb(self.path, log, msgspec.to_builtins(config))

    def _rewind(self, step: int) -> None:
        """Drop the records of steps >= `step` (a restart runs them again)."""
        self._metrics.close()
        truncate_metrics(self.path, step - 1)
        self._metrics = open(self.path / METRICS, "a")  # noqa: SIM115
        if self._tb is not None:
            self._tb.close()
            self._tb = self._tb_writer(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._last is not None and step <= self._last:
            self._rewind(step)
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._metrics.write(json.dumps({"step": step, **clean}) + "\n")
        self._metrics.flush()
        self._last = step
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def history(self) -> list[dict[str, float]]:
        """The logged steps, last entry per step winning."""
        by_step = {int(row["step"]): row for row in read_metrics(self.path)}
        return [by_step[s] for s in sorted(by_step)]

    def close(self, *, plot: bool = True) -> Path | None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        return plot_summary(self.history(), self.path / "summary.png") if plot else None


def open_wandb(path: Path, log: Any, config: dict[str, Any]) -> Any:
    """A W&B run writing under RUN_DIR/wandb (mode from WANDB_MODE; offline needs no network). Each attempt
    of a run (the first, every `yatt resume`) is its own W&B run grouped under the run directory's name:
    W&B keeps a run's steps increasing, so a resumed attempt could not log its steps again into the first."""
    try:
        import wandb
    except ImportError:
        raise ValueError("log.wandb=true needs wandb: pip install 'yatt-apps[wandb]'") from None
    return wandb.init(
        project=log.project,
        name=log.run_name or path.name,
        group=path.name,
        dir=str(path),
        config=config,
        reinit="create_new",
    )


def plot_panels(history: list[dict[str, float]]) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """The panels summary.png draws: (title, {metric: [(step, value), ...]}) for each of PLOT_PANELS that has a
    series. A panel with no series is left out; one whose every value is the same says so in its title
    ("constant 1"), so a flat line is read as what it is, not as a plotting failure."""
    names = sorted({k for row in history for k in row})
    panels = []
    for title, patterns in PLOT_PANELS.items():
        keys = [k for k in names if any(fnmatchcase(k, p) for p in patterns)]
        series = {k: [(int(row["step"]), row[k]) for row in history if k in row] for k in keys}
        values = {v for points in series.values() for _, v in points}
        if not values:
            continue
        panels.append((f"{title} (constant {values.pop():g})" if len(values) == 1 else title, series))
    return panels


def phase_keys(history: list[dict[str, float]]) -> list[str]:
    """The step's phase timings (`ctx.phase` seconds) that summary.png stacks: every time/ figure except the
    totals, the streaming busy times and the 0/1 flag (NOT_PHASES)."""
    return sorted({k for row in history for k in row if k.startswith(TIMING_PREFIX) and k not in NOT_PHASES})


def _legend_below(ax: Any) -> None:
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def plot_summary(history: list[dict[str, float]], out: Path) -> Path | None:
    """Draw validation accuracy, judge agreement, reward per term, KL, response length and stacked phase times
    against step into one PNG (see `plot_panels`)."""
    if not history:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [row["step"] for row in history]
    panels = plot_panels(history)
    # a Figure of its own (no pyplot: no global figure state, nothing to close) on the Agg canvas, and a fixed
    # layout: tight_layout measured every tick label once more before the real draw, about a third of the
    # plot's time (a plot is drawn at the end of every run). Legends go below each panel (never over the
    # data): the bottom margin leaves room for up to ~6 legend rows under the axes
    fig = Figure(figsize=(4 * (len(panels) + 1), 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels) + 1, squeeze=False)[0]
    fig.subplots_adjust(left=0.035, right=0.995, top=0.93, bottom=0.33, wspace=0.28)
    for ax, (title, series) in zip(axes, panels, strict=False):
        for key, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=key)
        if len(series) > 1:
            _legend_below(ax)
        ax.set_title(title, fontsize=9)
    phases = phase_keys(history)
    bottom = [0.0] * len(steps)
    for phase in phases:
        values = [row.get(phase, 0.0) for row in history]
        axes[-1].bar(steps, values, bottom=bottom, label=phase.removeprefix(TIMING_PREFIX))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[-1].set_title("phase time (s)", fontsize=9)
    if phases:
        _legend_below(axes[-1])
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))  # steps are whole numbers
    partial = out.with_name(f".{out.name}.partial")  # a full disk leaves no half-written (0-byte) PNG
    try:
        fig.savefig(partial, dpi=90, format="png")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out
