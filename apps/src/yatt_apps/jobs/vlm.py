"""GRPO on a vision-language policy (`yatt grpo-vlm`): the flagship step with image prompts.

Rows carry image paths (`DataSpec.image_key`, jsonl or parquet; each image is checked to decode when the file
is read). The rollout engine loads a row's images and expands its placeholders itself; the learner needs the
same expanded prompt and the pixels, so `vlm_step` builds them per prompt (`prompt_vision`) and pads them per
row beside the [B, T] batch (`vision_batch`: yatt_algos' learner keeps per-row fields whole through
micro-batching). Rewards are rule terms on the response text. Without user data the job writes the embedded
task into the run directory first: small PNGs of red and blue squares, "How many red squares?".

Decision: a sample whose response contains a vision special token (a tiny policy can sample one) is dropped
before training and counted in `samples_dropped`: in the learner's forward it would be taken for an image
placeholder without pixels.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from yatt_apps.config import RunConfig, tiny_cpu_vlm
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime import policy_inputs
from yatt_apps.runtime.job import JobDef, StepFn, ValRows
from yatt_apps.runtime.phases import (
    kept_batch,
    old_logprobs,
    push_weights,
    rollout_and_score,
    sleep_engines,
    tokenizer,
    train_policy,
)
from yatt_apps.runtime.step_metrics import maybe_evaluate, sample_sums, summarize

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_placement.types import PlacementPlan

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CELL, GRID = 14, 4  # the embedded images: a 4 x 4 grid of 14-pixel cells (56 x 56, one patch per cell)


@functools.cache
def image_processor(path: str) -> Any:
    """The image processor of the model folder `path`, loaded once per process."""
    from yatt_apps.io.models import load_image_processor

    return load_image_processor(path)


# ---- the embedded task ----------------------------------------------------------------------------------


def draw_squares(num_red: int, num_blue: int, rng: random.Random) -> Any:
    """A 56 x 56 white PIL image with `num_red` red and `num_blue` blue squares in distinct grid cells."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CELL * GRID, CELL * GRID), "white")
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range(GRID * GRID), num_red + num_blue)
    for k, cell in enumerate(cells):
        x, y = (cell % GRID) * CELL, (cell // GRID) * CELL
        draw.rectangle([x + 2, y + 2, x + CELL - 3, y + CELL - 3], fill="red" if k < num_red else "blue")
    return image


def write_image_task(out: Path, name: str, num_rows: int, seed: int) -> Path:
    """`out/name.jsonl` and its PNGs under `out/name/`: 0-4 red squares and 0-3 blue ones per image, the
    answer the red count. Deterministic in `seed`; written atomically (a rerun reuses a complete file)."""
    path = out / f"{name}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(seed)
    (out / name).mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(num_rows):
        red, blue = rng.randint(0, 4), rng.randint(0, 3)
        image = f"{name}/{i:05d}.png"
        draw_squares(red, blue, rng).save(out / image)
        row = PromptRow(prompt="How many red squares?", answer=str(red), images=[image])
        lines.append(msgspec.json.encode(row).decode())
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def with_embedded_task(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """`cfg` reading the embedded image task, written into `run_dir/data` (user data: unchanged)."""
    if cfg.data.train:
        return cfg
    data_dir = run_dir.resolve() / "data"
    train = write_image_task(data_dir, "train", cfg.data.num_train_rows, cfg.run.seed)
    val = write_image_task(data_dir, "val", cfg.data.num_val_rows, cfg.run.seed + 10_000)
    data = msgspec.structs.replace(cfg.data, train=str(train), val=str(val))
    return msgspec.structs.replace(cfg, data=data)


def check(cfg: RunConfig) -> None:
    """A tiny policy built here must be the vision-language one (a user's model.path is checked on load)."""
    if cfg.model.arch != "qwen2_vl" and not cfg.model.path:
        raise ValueError(f"grpo-vlm needs a vision-language policy: model.arch is {cfg.model.arch!r}")
    policy_inputs.check_estimator(cfg, "grpo-vlm", (), "torch")


# ---- the step ---------------------------------------------------------------------------------------------


def prompt_vision(tok: Any, processor: Any, prompt_ids: list[int], row: PromptRow) -> dict[str, Any]:
    """The prompt as the learner sees it: input_ids with every image placeholder expanded [T_p], and the
    image inputs pixel_values [P, D], image_grid_thw [N, 3] (the same processing as the rollout engine)."""
    from yatt_multimodal.vlm import qwen2_vl_inputs
    from yatt_rollout.media import load_image
    from yatt_rollout.types import MediaRef

    images = [load_image(MediaRef(kind="image", uri=p)) for p in row.images]
    out = qwen2_vl_inputs(tok, processor, prompt_ids, images)
    return {
        "prompt_ids": out["input_ids"][0].tolist(),
        "pixel_values": out.get("pixel_values"),
        "image_grid_thw": out.get("image_grid_thw"),
    }


def vision_batch(items: list[dict[str, Any]], batch: dict[str, Any], image_pad_id: int) -> dict[str, Any]:
    """Per-row image fields for rows whose prompts are `items`: pixel_values [B, P, D] and image_grid_thw
    [B, N, 3] zero padded, and mm_token_type_ids [B, T] (1 on the prompt's image tokens)."""
    import torch

    pixels = [it["pixel_values"] for it in items if it["pixel_values"] is not None]
    dim = pixels[0].shape[-1] if pixels else 1
    num_patches = max((len(p) for p in pixels), default=0)
    num_images = max(
        (len(it["image_grid_thw"]) for it in items if it["image_grid_thw"] is not None), default=0
    )
    pixel_values = torch.zeros(len(items), num_patches, dim)
    grids = torch.zeros(len(items), num_images, 3, dtype=torch.long)
    for b, it in enumerate(items):
        if it["pixel_values"] is not None:
            pixel_values[b, : len(it["pixel_values"])] = it["pixel_values"]
            grids[b, : len(it["image_grid_thw"])] = it["image_grid_thw"]
    image_tokens = (batch["input_ids"] == image_pad_id) & ~batch["response_mask"]
    return {"pixel_values": pixel_values, "image_grid_thw": grids, "mm_token_type_ids": image_tokens.long()}


def vlm_step(
    ctx: StepContext,
    rows: list[PromptRow],
    *,
    cfg: RunConfig,
    policy_dir: str,
    val_rows: ValRows,
    plan: PlacementPlan,
) -> dict[str, float]:
    """One GRPO step on image prompts on this controller's `rows`; metrics reduced over controllers."""
    import torch
    from yatt_algos.advantages import ADVANTAGE_ESTIMATORS

    tok, processor = tokenizer(policy_dir), image_processor(policy_dir)
    vision_ids = set(tok.convert_tokens_to_ids(list(VISION_TOKENS)))

    with ctx.phase("rollout_reward"):  # the engine loads each row's images; rule terms on the response text
        prompt_ids, scored = rollout_and_score(ctx, cfg, rows, tok)
        scored.keep = [
            k and not vision_ids & set(c.token_ids)
            for k, c in zip(scored.keep, scored.completions, strict=True)
        ]
    sums = maybe_evaluate(ctx, val_rows, cfg, tok)
    sleep_engines(ctx, cfg, plan)

    with ctx.phase("advantages"):  # expanded prompts and pixels per row, then group-normalized advantages
        vision = [prompt_vision(tok, processor, ids, row) for ids, row in zip(prompt_ids, rows, strict=True)]
        kept, samples, batch = kept_batch(scored, [v["prompt_ids"] for v in vision], tok)
        batch |= vision_batch(
            [vision[scored.owner[i]] for i in kept], batch, tok.convert_tokens_to_ids("<|image_pad|>")
        )
        group_ids = torch.tensor([scored.owner[i] for i in kept])
        score_t = torch.tensor([scored.scores[i] for i in kept], dtype=torch.float32)
        advantages, _ = ADVANTAGE_ESTIMATORS[cfg.algo.adv_estimator](
            score_t, batch["response_mask"], cfg.algo, group_ids=group_ids
        )

    with ctx.phase("logprobs"):  # old and reference logprobs through the vision tower too
        lp, rollout_lp = old_logprobs(ctx, batch, samples)
        lp, policy_lp = policy_inputs.old_policy(cfg, lp, rollout_lp)  # bypass mode: the rollout's

    with ctx.phase("train"):  # SPMD across controllers
        stats = train_policy(ctx, batch, lp, rollout_lp, advantages, group_ids=group_ids)

    push_weights(ctx, cfg, plan)

    sums |= sample_sums(scored, kept, len(rows), batch["response_mask"], lp, rollout_lp)
    sums |= policy_inputs.offpolicy_sums(cfg, policy_lp, rollout_lp, batch["response_mask"])
    return summarize(ctx.all_reduce(sums), stats, ctx.world_size)


def step_function(cfg: RunConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    return functools.partial(vlm_step, cfg=cfg, policy_dir=policy_dir, val_rows=val_rows, plan=plan)


JOB = JobDef(
    name="grpo-vlm",
    help="GRPO on a vision-language policy with image prompts (default: tiny Qwen2-VL, counting squares)",
    preset=tiny_cpu_vlm,
    step=step_function,
    check=check,
    prepare=with_embedded_task,
)
