"""Image rewards: the pixel rule on hand-made images (exact values), the tiny CLIP-style Bradley-Terry reward
model trained on rendered pairs, and the tiny Qwen2-VL judge scoring images a tiny diffusion policy rendered."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from yatt_multimodal.image_rules import (
    colour_position_score,
    colour_prompts,
    every_colour_prompt,
    parse_colour_prompt,
    score_images,
)
from yatt_multimodal.types import RewardRequest

torch = pytest.importorskip("torch")


def _image(left: tuple[int, int, int], right: tuple[int, int, int], size: int = 8) -> np.ndarray:
    image = np.zeros((size, size, 3), dtype=np.uint8)
    image[:, : size // 2] = left
    image[:, size // 2 :] = right
    return image


def test_rule_reward_on_hand_made_images() -> None:
    red_left = _image((255, 0, 0), (0, 255, 0))
    assert colour_position_score(red_left, "red", "left") == 1.0
    assert colour_position_score(red_left, "red", "right") == 0.25  # green: (1 + 0 - (1 + 0) / 2) / 2
    assert colour_position_score(red_left, "green", "right") == 1.0
    assert colour_position_score(red_left, "blue", "left") == 0.25
    grey = np.full((8, 8, 3), 128, dtype=np.uint8)
    assert colour_position_score(grey, "yellow", "top") == 0.5
    yellow_top = np.zeros((8, 8, 3), dtype=np.uint8)
    yellow_top[:4] = (255, 255, 0)
    assert colour_position_score(yellow_top, "yellow", "top") == 1.0
    assert colour_position_score(yellow_top, "yellow", "bottom") == 0.5


def test_rule_reward_parses_prompts_and_names_bad_ones() -> None:
    assert parse_colour_prompt("A Red square on the LEFT") == ("red", "left")
    prompts = colour_prompts(50, seed=3)
    assert prompts == colour_prompts(50, seed=3) and len(set(prompts)) > 8
    every = every_colour_prompt()
    assert len(set(every)) == 16 and {parse_colour_prompt(p) for p in every} == {
        (c, s) for c in ("red", "green", "blue", "yellow") for s in ("left", "right", "top", "bottom")
    }
    requests = [
        RewardRequest(request_id="a", prompt="a blue square on the right", response=""),
        RewardRequest(request_id="b", prompt="a cat", response=""),
    ]
    blue_right = _image((0, 0, 0), (0, 0, 255))
    good, bad = score_images(requests, [blue_right, blue_right])
    assert good.score == 1.0 and good.components == {"colour_position": 1.0}
    assert bad.status == "error" and "'a cat' names no colour" in bad.error
    with pytest.raises(ValueError, match="expected a uint8 RGB image"):
        colour_position_score(np.zeros((4, 4), dtype=np.uint8), "red", "left")


@pytest.fixture(scope="module")
def rendered():
    """Prompts and images rendered by a tiny SD3-style policy (the t2i job's engine), 16x16."""
    pytest.importorskip("diffusers")
    from yatt_rollout.diffusion_engine import DiffusionEngine, DiffusionSampling
    from yatt_rollout.diffusion_models import tiny_t2i

    torch.set_num_threads(1)
    prompts = colour_prompts(8, seed=0)
    policy = tiny_t2i(prompts * 4, image_size=16, hidden_size=32)
    out = DiffusionEngine(policy, DiffusionSampling(num_steps=3, eta=0.5, image_size=16)).generate(
        prompts, list(range(8))
    )
    return prompts, out.images, policy.tokenizers[0]


def test_bradley_terry_reward_model_learns_rendered_preferences(rendered) -> None:
    from yatt_multimodal.image_rewards import bradley_terry_loss, tiny_image_reward_model

    prompts, images, tok = rendered
    rm = tiny_image_reward_model(tok, image_size=16)
    # preference: the rendered image with its own prompt over the same image with the red-left rule's
    # opposite (a hand-made pure-green left half pasted in): the model must tell them apart
    rejected = images.copy()
    rejected[:, :, :8] = (0, 255, 0)
    opt = torch.optim.Adam(rm.parameters(), lr=3e-3)
    with torch.no_grad():
        before = float(bradley_terry_loss(rm(prompts, images), rm(prompts, rejected)))
    assert before == pytest.approx(np.log(2), abs=0.1)  # an untrained head barely separates them
    for _ in range(15):
        loss = bradley_terry_loss(rm(prompts, images), rm(prompts, rejected))
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        chosen, worse = rm(prompts, images), rm(prompts, rejected)
    assert float(bradley_terry_loss(chosen, worse)) < before / 2 and bool((chosen > worse).all())
    requests = [RewardRequest(request_id=str(i), prompt=p, response="") for i, p in enumerate(prompts)]
    scored = rm.score(requests, images)
    assert [r.score for r in scored] == pytest.approx(chosen.tolist(), abs=1e-5)
    assert scored[0].components == {"image_rm": scored[0].score}


def test_vlm_judge_scores_rendered_images(rendered, tmp_path) -> None:
    hf_engine = pytest.importorskip("yatt_rollout.hf_engine")
    from yatt_multimodal.genrm import GenRMJudge
    from yatt_multimodal.image_rewards import consistency_requests
    from yatt_multimodal.types import JudgeSpec
    from yatt_multimodal.vlm import QwenVLCodec
    from yatt_rollout.tiny import VISION_TOKENS, tiny_qwen2_vl, train_tokenizer

    prompts, images, _ = rendered
    tokenizer = train_tokenizer(
        [*prompts, "Verdict: Yes. Verdict: No."] * 20, vocab_size=400, extra_special_tokens=VISION_TOKENS
    )
    model, processor = tiny_qwen2_vl(tokenizer)
    engine = hf_engine.HFEngine(model, tokenizer, processor=processor, max_batch_size=8)
    requests = consistency_requests(prompts[:3], images[:3], tmp_path)
    try:
        batch = asyncio.run(
            GenRMJudge(engine, QwenVLCodec(tokenizer), JudgeSpec(num_samples=2, max_new_tokens=8)).score(
                requests
            )
        )
    finally:
        engine.close()
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["img-0.png", "img-1.png", "img-2.png"]
    assert requests[0].metadata == {"t2i_prompt": prompts[0]} and prompts[0] in requests[0].prompt
    # a random tiny judge states no verdict: each image is judged twice and counted, never a silent zero
    assert [r.status for r in batch.rewards] == ["parse_error"] * 3 or batch.metrics.num_ok > 0
    assert batch.metrics.num_judgements == 6
