"""`yatt grpo-t2i`: bad rows, sizes and reward settings refused with their file/row/key, the validation grid
(PNG and an offline W&B run), and two steps of the tiny job end to end in disaggregated placement with the
pixel rule, the image reward model and the VLM judge as weighted reward roles (images in the run folder, a
diffusers export from the run and from `yatt export`, an exact resume)."""

from __future__ import annotations

import json
import math
import shutil
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from yatt_apps.jobs.grpo_t2i import JOB, T2iSpec, check, export, tiny_cpu_t2i, train_rows, val_prompts
from yatt_apps.runtime.t2i_images import ValidationImages, write_grid
from yatt_multimodal.types import RewardSpec


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


def test_bad_reward_settings_name_their_keys() -> None:
    from yatt_apps.config import ModelSpec

    cfg = tiny_cpu_t2i()
    assert [(s.kind, s.weight) for s in cfg.rewards] == [("colour_position", 1.0)] and cfg.judge is None
    with pytest.raises(ValueError, match=r"rewards\[0\]\.kind 'math_verify' is not an image reward; known: "):
        check(msgspec.structs.replace(cfg, rewards=[RewardSpec(kind="math_verify")]))
    with pytest.raises(ValueError, match=r"^rewards is empty"):
        check(msgspec.structs.replace(cfg, rewards=[]))
    judged = msgspec.structs.replace(cfg, judge=ModelSpec(arch="qwen2_vl"))
    with pytest.raises(ValueError, match=r"judge is set but no rewards term of kind 'genrm' uses it"):
        check(judged)
    vllm = msgspec.structs.replace(
        judged, judge=ModelSpec(arch="qwen2_vl", engine="vllm"), rewards=[RewardSpec(kind="genrm")]
    )
    with pytest.raises(ValueError, match=r"judge\.engine='vllm': grpo-t2i's VLM judge reads images"):
        check(vllm)


def test_reward_roles_are_placed_as_the_llm_jobs() -> None:
    """The rule-only reward role shares the rollout engines' devices (colocated: every device; disaggregated:
    the engine's, no device of its own); with a judge model the `genrm` role takes devices of its own."""
    from yatt_apps.runtime.launch import placement_plan
    from yatt_placement.types import ClusterSpec

    cfg = tiny_cpu_t2i()
    plan = {r.role: r.replicas for r in placement_plan(cfg, JOB).roles}
    assert plan == {"actor": [[0], [1]], "rollout": [[0], [1]], "reward": [[0], [1]]}
    split = msgspec.structs.replace(
        cfg.placement,
        mode="disaggregated",
        rollout_replicas=1,
        cluster=ClusterSpec(num_nodes=1, devices_per_node=3, device_memory_gb=16.0),
    )
    plan = {
        r.role: r.replicas for r in placement_plan(msgspec.structs.replace(cfg, placement=split), JOB).roles
    }
    assert plan == {"actor": [[0], [1]], "rollout": [[2]], "reward": [[2]]}


def test_reward_metrics_have_the_llm_jobs_names() -> None:
    """Per-term means over the kept images, statuses of every image, the judge's parse rate and its agreement
    with the pixel rule (verdict > 0 against rule > 0.5), from hand-made scores."""
    from yatt_apps.runtime.t2i_rewards import agreement_sums, reward_means, reward_sums

    scored = {
        "statuses": ["ok", "error", "ok"],
        "sample_components": [
            {"colour_position": 0.9, "genrm": 1.0, "genrm/parsed": 1.0},
            {"genrm": -1.0, "genrm/parsed": 0.5},
            {"colour_position": 0.2, "genrm": 1.0, "genrm/parsed": 0.5},
        ],
        "judgements": 6,
        "unparsed": 2,
    }
    specs = [RewardSpec(kind="colour_position"), RewardSpec(kind="genrm", weight=0.1)]
    kept = [0, 2]
    sums = reward_sums(scored, kept, prefix="val/") | agreement_sums(
        specs, [scored["sample_components"][i] for i in kept], prefix="val/"
    )
    assert reward_means(sums, 2.0, prefix="val/") == pytest.approx(
        {
            "val/reward/colour_position_mean": 0.55,
            "val/reward/genrm_mean": 1.0,
            "val/reward/genrm/parsed_mean": 0.75,
            "val/reward_status/ok": 2.0,
            "val/reward_status/error": 1.0,
            "val/reward_status/parse_error": 0.0,
            "val/reward_status/timeout": 0.0,
            "val/judge/parse_rate": 4 / 6,
            "val/judge/judgements": 6.0,
            "val/judge/agreement": 0.5,  # image 0 agrees (yes, 0.9), image 2 does not (yes, 0.2)
        },
        abs=1e-12,
    )
    assert agreement_sums(specs[:1], scored["sample_components"]) == {}


def test_validation_images_reach_an_offline_wandb_run(tmp_path, monkeypatch, wandb_records) -> None:
    """log.wandb=true: controller 0's grids go to a W&B run of their own (`<name>-images`, grouped with the
    driver's run under the run folder's name), one image per evaluated step, finished at the last."""
    from yatt_apps.config import LogSpec

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    base = tiny_cpu_t2i()
    spec = msgspec.structs.replace(
        base.t2i,
        images_dir=str(tmp_path / "images"),
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_dir=str(tmp_path),
    )
    cfg = msgspec.structs.replace(base, t2i=spec, log=LogSpec(wandb=True, project="yatt-test"))
    images = np.zeros((3, 4, 4, 3), dtype=np.uint8)
    sink = ValidationImages(cfg)
    sink.write(images, 0, last=False)
    sink.write(images + 200, 5, last=True)
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    deadline = time.monotonic() + 60  # finish() returns before W&B's service process has written everything
    while "exit" not in wandb_records.types(offline) and time.monotonic() < deadline:
        time.sleep(0.2)
    logged = wandb_records.history(offline)
    assert [row["_step"] for row in logged] == [0, 5]
    assert [row["val/images/_type"] for row in logged] == ["image-file"] * 2
    assert [row["val/images/caption"] for row in logged] == ["step 0", "step 5"]
    # the grid (3 images of 4 x 4 in one row, x4) as W&B stored it beside the run
    from PIL import Image

    stored = np.asarray(Image.open(offline / "files" / logged[1]["val/images/path"]))
    assert stored.shape == (16, 48, 3) and (stored == 200).all()
    (run,) = [rec.run for rec in wandb_records.read(offline) if rec.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.run_group, run.job_type) == (
        f"{tmp_path.name}-images",
        tmp_path.name,
        "t2i-images",
    )
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["step-000000.png", "step-000005.png"]


def test_grid_holds_every_image_in_rows_of_eight(tmp_path) -> None:
    from PIL import Image

    images = np.zeros((10, 4, 4, 3), dtype=np.uint8)
    images[9] = 255
    path = write_grid(images, tmp_path / "grid.png")
    grid = np.asarray(Image.open(path))
    assert grid.shape == (2 * 4 * 4, 8 * 4 * 4, 3)  # 2 rows of 8, each image scaled x4
    assert (grid[16:, 16:32] == 255).all() and (grid[:16, :16] == 0).all() and (grid[16:, 32:] == 255).all()


def _judged_disaggregated(base):
    """`base` with the three image rewards (pixel rule 1.0, tiny image RM 0.1, tiny Qwen2-VL judge 0.1 with two
    constrained verdicts), on 4 devices: the learner ranks, one rollout engine and the judge each their own."""
    from yatt_apps.config import TINY_JUDGE, ModelSpec
    from yatt_placement.types import ClusterSpec

    placement = msgspec.structs.replace(
        base.placement,
        mode="disaggregated",
        rollout_replicas=1,
        cluster=ClusterSpec(num_nodes=1, devices_per_node=4, device_memory_gb=16.0),
    )
    rewards = [
        RewardSpec(kind="colour_position", weight=1.0),
        RewardSpec(kind="image_rm", weight=0.1, options={"seed": "1"}),
        RewardSpec(kind="genrm", weight=0.1, judge=msgspec.structs.replace(TINY_JUDGE, template_version=1)),
    ]
    judge = ModelSpec(arch="qwen2_vl", seed=1, max_position_embeddings=1024)
    return msgspec.structs.replace(base, placement=placement, rewards=rewards, judge=judge)


@pytest.mark.slow
def test_tiny_t2i_runs_exports_and_resumes_exactly(ray_session, tmp_path) -> None:
    """Two steps of `tiny_cpu_t2i` (two controllers, random tiny VAE, evaluated at both steps) in
    disaggregated placement with three weighted reward terms (`_judged_disaggregated`): metrics finite, the
    combined reward the weighted sum of the per-term means, every judge verdict parsed, a grid per evaluation,
    the diffusers export loads and `yatt export` writes the same folder from the last checkpoint; a copy cut
    back to its step-0 checkpoint and resumed in colocated placement redoes step 1 with the same metrics and
    the same final weights (every image and verdict is seeded per sample, whichever process serves it)."""
    import torch
    import yatt_apps.runtime.launch as launch
    from safetensors.torch import load_file
    from yatt_apps.io.export import export_checkpoint
    from yatt_rollout.diffusion_models import load_t2i

    base = tiny_cpu_t2i()
    cfg = _judged_disaggregated(
        msgspec.structs.replace(
            base,
            run=msgspec.structs.replace(
                base.run, num_steps=2, eval_every=1, prompts_per_step=2, progress=False
            ),
            data=msgspec.structs.replace(base.data, num_val_rows=4),
            sampling=msgspec.structs.replace(base.sampling, n=4),
            controller=msgspec.structs.replace(base.controller, checkpoint_every=1),
            t2i=msgspec.structs.replace(base.t2i, num_steps=3, tiny_vae_steps=0),
        )
    )
    plan = {r.role: r.replicas for r in launch.placement_plan(cfg, JOB).roles}
    assert plan == {"actor": [[0], [1]], "rollout": [[2]], "genrm": [[3]]}
    straight = tmp_path / "straight"
    launch.run_job(cfg, straight, JOB)
    rows = {r["step"]: r for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1]
    for step in (0, 1):
        row = rows[step]
        for key in ("reward/mean", "val/reward", "train/loss", "train/grad_norm", "t2i/images_per_s"):
            assert math.isfinite(row[key]), (step, key)
        terms = (row["reward/colour_position_mean"], row["reward/image_rm_mean"], row["reward/genrm_mean"])
        assert 0.0 <= terms[0] <= 1.0 and -1.0 <= terms[2] <= 1.0
        assert row["reward/mean"] == pytest.approx(terms[0] + 0.1 * terms[1] + 0.1 * terms[2], abs=1e-6)
        # 8 images a step (+ 4 validation images), K = 2 constrained verdicts each: all parse
        assert row["reward_status/ok"] == 8 and row["samples_dropped"] == 0 and row["judge/judgements"] == 16
        assert row["judge/parse_rate"] == 1.0 and row["reward/genrm/parsed_mean"] == 1.0
        assert row["val/reward_status/ok"] == 4 and row["val/judge/judgements"] == 8
        assert 0.0 <= row["judge/agreement"] <= 1.0
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
    name = "transformer/diffusion_pytorch_model.safetensors"
    record = export_checkpoint(straight, None, tmp_path / "exported")  # `yatt export RUN_DIR --out DIR`
    assert (record["step"], record["format"]) == (1, "diffusers")
    mine, theirs = load_file(tmp_path / "exported" / name), load_file(straight / "final" / name)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ValueError, match=r"is not a run directory \(no config\.yaml\)"):
        export_checkpoint(straight / "images", None, tmp_path / "nothing")

    cut = tmp_path / "cut"
    shutil.copytree(straight, cut, ignore=shutil.ignore_patterns("final"))
    ckpts = sorted(p for p in (cut / "checkpoints").iterdir() if p.is_dir())
    assert [p.name[-1] for p in ckpts] == ["0", "1"]
    shutil.rmtree(ckpts[1])
    # resumed colocated (every role in the two devices' processes): placement moves no number
    launch.run_job(msgspec.structs.replace(cfg, placement=base.placement), cut, JOB)
    resumed = {r["step"]: r for r in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines())}
    a, b = (
        {
            k: v
            for k, v in r[1].items()
            if not k.startswith(("time/", "throughput/", "t2i/images_per_s", "sync/bytes"))
        }
        for r in (resumed, rows)
    )
    # the pushes reach two engines (one per device) where they reached one
    assert resumed[1]["sync/bytes"] == 2 * rows[1]["sync/bytes"] > 0
    assert "val/reward" in a and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    mine, theirs = load_file(cut / "final" / name), load_file(straight / "final" / name)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
