"""A run directory: the resolved config, metrics as JSONL and TensorBoard events, checkpoints, and a final plot.

Layout:
    RUN_DIR/config.yaml         the resolved config (what `yatt resume RUN_DIR` reloads)
    RUN_DIR/metrics.jsonl       one JSON object per step (appended, flushed, so a killed run keeps its history)
    RUN_DIR/tb/                 TensorBoard events of the same scalars
    RUN_DIR/checkpoints/        written by yatt_controller's atomic checkpointer
    RUN_DIR/summary.png         reward, KL, response length and phase times, drawn at the end
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from yatt_apps.overlay import to_yaml

# metric-name prefixes drawn in summary.png, one panel each
PLOT_PANELS = {"reward": "reward/mean", "kl": "train/kl", "response length": "rollout/response_len_mean"}
TIMING_PREFIX = "time/"


class RunDir:
    """Owns one run's directory. `log` appends a step's scalars; `close` flushes and draws the plot."""

    def __init__(self, path: str | Path, *, tensorboard: bool = True):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(exist_ok=True)
        self._metrics = open(self.path / "metrics.jsonl", "a")  # noqa: SIM115 (held for the run)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path / "tb"))

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_config(self, config: msgspec.Struct) -> None:
        tmp = self.path / "config.yaml.tmp"
        tmp.write_text(to_yaml(config))
        tmp.replace(self.path / "config.yaml")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._metrics.write(json.dumps({"step": step, **clean}) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)

    def history(self) -> list[dict[str, float]]:
        """The logged steps, last entry per step winning (a resumed run re-logs the steps after its checkpoint)."""
        by_step: dict[int, dict[str, float]] = {}
        path = self.path / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = row
        return [by_step[s] for s in sorted(by_step)]

    def close(self, *, plot: bool = True) -> Path | None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        return plot_summary(self.history(), self.path / "summary.png") if plot else None


def plot_summary(history: list[dict[str, float]], out: Path) -> Path | None:
    """Draw reward, KL, response length and stacked phase times against step into one PNG."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in history]
    fig, axes = plt.subplots(1, len(PLOT_PANELS) + 1, figsize=(4 * (len(PLOT_PANELS) + 1), 3.2))
    for ax, (title, key) in zip(axes, PLOT_PANELS.items(), strict=False):
        ax.plot(steps, [row.get(key, math.nan) for row in history], marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("step")
    phases = sorted({k for row in history for k in row if k.startswith(TIMING_PREFIX) and k != "time/step"})
    bottom = [0.0] * len(steps)
    for phase in phases:
        values = [row.get(phase, 0.0) for row in history]
        axes[-1].bar(steps, values, bottom=bottom, label=phase.removeprefix(TIMING_PREFIX))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[-1].set_title("phase time (s)")
    axes[-1].set_xlabel("step")
    if phases:
        axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
