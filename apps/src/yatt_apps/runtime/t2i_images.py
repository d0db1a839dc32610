"""Where `yatt grpo-t2i`'s validation images go: a PNG grid per evaluated step in RUN_DIR/images, the same
images to TensorBoard (RUN_DIR/tb, beside the driver's scalars) and, with `log.wandb=true`, to W&B.

Only controller 0 writes, in its own process: the images never reach the driver. W&B keeps one writer per
run, and the driver's W&B run holds the scalars, so the images go to a W&B run of their own
(`<run name>-images`, job type `t2i-images`) in the same group as the driver's (the run directory's name):
W&B's grouping of a distributed job's processes, shown side by side in the project.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ValidationImages", "write_grid"]


def write_grid(images: Any, path: Path) -> Path:
    """A PNG of `images` [N, H, W, 3] uint8 in rows of up to 8, each image scaled x4 (atomic: tmp + rename)."""
    from PIL import Image

    grid = grid_array(images)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(grid).save(tmp, format="PNG")
    tmp.replace(path)
    return path


def grid_array(images: Any, scale: int = 4) -> Any:
    """`images` [N, H, W, 3] uint8 tiled in rows of up to 8 on white, scaled x`scale` (nearest):
    [rows * H * scale, cols * W * scale, 3] uint8."""
    import numpy as np

    n, h, w, _ = images.shape
    cols = min(n, 8)
    rows = -(-n // cols)
    grid = np.full((rows * h, cols * w, 3), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = image
    return grid.repeat(scale, axis=0).repeat(scale, axis=1)


class ValidationImages:
    """Controller 0's image writers, opened on first use in its process and never pickled (the step function
    that holds this object is sent to every controller). `cfg`: the job's config (t2i.images_dir,
    t2i.tensorboard_dir, t2i.wandb_dir, log)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self._tb: Any = None
        self._wandb: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"cfg": self.cfg, "_tb": None, "_wandb": None}

    def write(self, images: Any, step: int, *, last: bool) -> Path:
        """The grid of `images` [N, H, W, 3] at `step` to every sink; `last`: the run's last evaluation, after
        which the W&B run is finished (its files complete)."""
        spec = self.cfg.t2i
        path = write_grid(images, Path(spec.images_dir) / f"step-{step:06d}.png")
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # its own event file beside the driver's scalars: TensorBoard reads every file in the folder
            self._tb = SummaryWriter(spec.tensorboard_dir, filename_suffix=".t2i-images")
        self._tb.add_images("val/images", images, step, dataformats="NHWC")
        self._tb.flush()
        if self.cfg.log.wandb:
            self._log_wandb(images, step, last)
        return path

    def _log_wandb(self, images: Any, step: int, last: bool) -> None:
        import wandb

        if self._wandb is None:
            log, folder = self.cfg.log, Path(self.cfg.t2i.wandb_dir)
            self._wandb = wandb.init(
                project=log.project,
                name=f"{log.run_name or folder.name}-images",
                group=folder.name,  # the driver's run is grouped under the run directory's name too
                job_type="t2i-images",
                dir=str(folder),
                reinit="create_new",
            )
        self._wandb.log({"val/images": wandb.Image(grid_array(images), caption=f"step {step}")}, step=step)
        if last:
            self.close()

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
