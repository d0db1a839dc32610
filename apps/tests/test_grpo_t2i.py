"""`yatt grpo-t2i`: bad rows and sizes refused with their file/row/field, the validation grid, and two steps
of the tiny job end to end (images in the run folder, a diffusers export, an exact resume)."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from yatt_apps.jobs.grpo_t2i import (
    JOB,
    T2iSpec,
    export,
    tiny_cpu_t2i,
    train_rows,
    val_prompts,
    write_grid,
)


def test_bad_rows_name_file_row_and_field(tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a red square on the left"}\n{"prompt": "a cat on a mat"}\n')
    cfg = tiny_cpu_t2i()
    bad = msgspec.structs.replace(cfg, data=msgspec.structs.replace(cfg.data, train=str(data)))
    with pytest.raises(
        ValueError, match=r"prompts\.jsonl:2: field 'prompt': prompt 'a cat on a mat' names no colour"
    ):
        train_rows(bad)
    data.write_text('{"text": "a red square on the left"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: missing field 'prompt' \(one prompt per row\)"):
        train_rows(bad)
    val = msgspec.structs.replace(cfg, data=msgspec.structs.replace(cfg.data, val=str(data)))
    with pytest.raises(ValueError, match=r"prompts\.jsonl"):
        val_prompts(val)


def test_bad_image_sizes_and_settings_name_their_keys() -> None:
    with pytest.raises(ValueError, match=r"t2i\.image_size must be a positive multiple of 4, got 18"):
        T2iSpec(image_size=18)
    with pytest.raises(ValueError, match=r"t2i\.eta must be > 0"):
        T2iSpec(eta=0.0)
    with pytest.raises(ValueError, match=r"t2i.num_train_steps must be in \[0, t2i.num_steps=6\]"):
        T2iSpec(num_train_steps=7)


def test_a_path_that_is_no_pipeline_names_the_key(tmp_path) -> None:
    from yatt_apps.jobs.grpo_t2i import prepare

    cfg = tiny_cpu_t2i()
    bad = msgspec.structs.replace(cfg, t2i=msgspec.structs.replace(cfg.t2i, path=str(tmp_path)))
    with pytest.raises(
        ValueError, match=r"^t2i\.path '.*' is not a diffusers pipeline folder \(no model_index\.json\)"
    ):
        prepare(bad, tmp_path / "run")


def test_grid_holds_every_image_in_rows_of_eight(tmp_path) -> None:
    from PIL import Image

    images = np.zeros((10, 4, 4, 3), dtype=np.uint8)
    images[9] = 255
    path = write_grid(images, tmp_path / "grid.png")
    grid = np.asarray(Image.open(path))
    assert grid.shape == (2 * 4 * 4, 8 * 4 * 4, 3)  # 2 rows of 8, each image scaled x4
    assert (grid[16:, 16:32] == 255).all() and (grid[:16, :16] == 0).all() and (grid[16:, 32:] == 255).all()


@pytest.mark.slow
def test_tiny_t2i_runs_exports_and_resumes_exactly(ray_session, tmp_path) -> None:
    """Two steps of `tiny_cpu_t2i` (two controllers, random tiny VAE, evaluated at both steps): metrics
    finite, a grid per evaluation, the diffusers export loads; a copy cut back to its step-0 checkpoint and
    resumed redoes step 1 with the same metrics and the same final weights."""
    import torch
    import yatt_apps.runtime.launch as launch
    from safetensors.torch import load_file
    from yatt_rollout.diffusion_models import load_t2i

    base = tiny_cpu_t2i()
    cfg = msgspec.structs.replace(
        base,
        run=msgspec.structs.replace(base.run, num_steps=2, eval_every=1, prompts_per_step=2, progress=False),
        data=msgspec.structs.replace(base.data, num_val_rows=4),
        sampling=msgspec.structs.replace(base.sampling, n=4),
        controller=msgspec.structs.replace(base.controller, checkpoint_every=1),
        t2i=msgspec.structs.replace(base.t2i, num_steps=3, tiny_vae_steps=0),
    )
    straight = tmp_path / "straight"
    launch.run_job(cfg, straight, JOB)
    rows = {r["step"]: r for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1]
    for step in (0, 1):
        for key in ("reward/mean", "val/reward", "train/loss", "train/grad_norm", "t2i/images_per_s"):
            assert math.isfinite(rows[step][key]), (step, key)
        assert 0.0 <= rows[step]["reward/mean"] <= 1.0
    assert sorted(p.name for p in (straight / "images").iterdir()) == ["step-000000.png", "step-000001.png"]
    assert len(list((straight / "tb").glob("*.t2i-images"))) == 1  # the grids as TensorBoard images too
    assert export(SimpleNamespace(path=straight), cfg) == straight / "final"  # what a launch hook reports
    exported = load_t2i(straight / "final")
    start = load_t2i(straight / "models" / "t2i")
    moved = [
        not torch.equal(a, b)
        for a, b in zip(exported.transformer.parameters(), start.transformer.parameters(), strict=True)
    ]
    assert any(moved)  # two updates changed the transformer

    cut = tmp_path / "cut"
    shutil.copytree(straight, cut, ignore=shutil.ignore_patterns("final"))
    ckpts = sorted(p for p in (cut / "checkpoints").iterdir() if p.is_dir())
    assert [p.name[-1] for p in ckpts] == ["0", "1"]
    shutil.rmtree(ckpts[1])
    launch.run_job(cfg, cut, JOB)
    resumed = {r["step"]: r for r in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines())}
    a, b = (
        {k: v for k, v in r[1].items() if not k.startswith(("time/", "throughput/", "t2i/images_per_s"))}
        for r in (resumed, rows)
    )
    assert "val/reward" in a and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    name = "transformer/diffusion_pytorch_model.safetensors"
    mine, theirs = load_file(cut / "final" / name), load_file(straight / "final" / name)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
