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
    """The judge term of the t2i job (`image_reward_specs`, kind genrm) on rendered images: free text from a
    random tiny judge states no verdict (parse errors, counted); verdicts constrained to two phrases are
    votes in {-1, 1}, averaged over K = 2, and weighted with the pixel rule's score."""
    hf_engine = pytest.importorskip("yatt_rollout.hf_engine")
    from yatt_multimodal.image_reward_specs import build_combined_images
    from yatt_multimodal.image_rewards import consistency_requests
    from yatt_multimodal.image_rules import colour_position_score
    from yatt_multimodal.types import JudgeSpec, RewardSpec
    from yatt_multimodal.vlm import QwenVLCodec
    from yatt_rollout.tiny import VISION_TOKENS, tiny_qwen2_vl, train_tokenizer

    prompts, images, _ = rendered
    tokenizer = train_tokenizer(
        [*prompts, "Verdict: Yes. Verdict: No."] * 20, vocab_size=400, extra_special_tokens=VISION_TOKENS
    )
    model, processor = tiny_qwen2_vl(tokenizer)
    engine = hf_engine.HFEngine(model, tokenizer, processor=processor, max_batch_size=8)
    requests = consistency_requests(prompts[:3], images[:3], tmp_path / "asked")
    assert [p.name for p in sorted((tmp_path / "asked").iterdir())] == ["img-0.png", "img-1.png", "img-2.png"]
    assert requests[0].metadata == {"t2i_prompt": prompts[0]} and prompts[0] in requests[0].prompt
    free = JudgeSpec(num_samples=2, max_new_tokens=8)
    voted = JudgeSpec(num_samples=2, max_new_tokens=8, choices=["Verdict: Yes", "Verdict: No"])
    resources = {"engine": engine, "codec": QwenVLCodec(tokenizer), "seed": 3, "folder": tmp_path / "j"}
    asks = [RewardRequest(request_id=f"r{i}", prompt=p, response="") for i, p in enumerate(prompts[:3])]
    try:
        free_batch = asyncio.run(
            build_combined_images([RewardSpec(kind="genrm", judge=free)], **resources).score(asks, images[:3])
        )
        specs = [RewardSpec(kind="colour_position"), RewardSpec(kind="genrm", weight=0.5, judge=voted)]
        batch = asyncio.run(build_combined_images(specs, **resources).score(asks, images[:3]))
    finally:
        engine.close()
    # free text: each image judged twice and counted; no verdict is a parse error, never a silent zero
    assert free_batch.metrics.num_judgements == 6 and [r.request_id for r in free_batch.rewards] == [
        "r0",
        "r1",
        "r2",
    ]
    unparsed = [r.status == "parse_error" for r in free_batch.rewards]
    assert free_batch.metrics.num_parse_error == sum(unparsed)
    # constrained: every verdict parses, the score is rule + 0.5 * mean vote
    assert [r.status for r in batch.rewards] == ["ok"] * 3 and batch.metrics.num_judgements == 6
    for reward, prompt, image in zip(batch.rewards, prompts, images, strict=False):
        rule = colour_position_score(image, *parse_colour_prompt(prompt))
        vote = reward.components["genrm"]
        assert vote in (-1.0, 0.0, 1.0) and reward.components["genrm/parsed"] == 1.0
        assert reward.components["colour_position"] == rule
        assert reward.score == pytest.approx(rule + 0.5 * vote, abs=1e-12)


def test_combined_image_rewards_weight_terms_and_name_bad_specs(rendered, tmp_path) -> None:
    """Pixel rule + a tiny image RM: the score is the weighted sum of the terms (each under its name); a
    prompt the rule cannot read fails that image only (status error, dropped by the default policy); a saved
    RM loads back with the same scores; bad specs and folders are named."""
    from yatt_multimodal.image_reward_specs import (
        build_combined_images,
        check_image_specs,
        image_rm_from_options,
    )
    from yatt_multimodal.image_rewards import load_image_reward_model, save_image_reward_model
    from yatt_multimodal.rewards import resolve_failures
    from yatt_multimodal.types import RewardSpec

    prompts, images, tok = rendered
    rm = image_rm_from_options({"seed": "1"}, tok, image_size=16)
    specs = [RewardSpec(kind="colour_position", name="rule"), RewardSpec(kind="image_rm", weight=0.25)]
    asks = [RewardRequest(request_id=str(i), prompt=p, response="") for i, p in enumerate(prompts)]
    asks[2] = RewardRequest(request_id="2", prompt="a cat", response="")
    batch = asyncio.run(build_combined_images(specs, image_rm=rm).score(asks, images))
    with torch.no_grad():
        rm_scores = rm([a.prompt for a in asks], images).tolist()
    for i, reward in enumerate(batch.rewards):
        if i == 2:
            assert reward.status == "error" and "'a cat' names no colour" in reward.error
            assert reward.score == pytest.approx(0.25 * rm_scores[2], abs=1e-6)  # the other term still counts
            continue
        rule = colour_position_score(images[i], *parse_colour_prompt(prompts[i]))
        assert reward.components == pytest.approx({"rule": rule, "image_rm": rm_scores[i]}, abs=1e-6)
        assert reward.score == pytest.approx(rule + 0.25 * rm_scores[i], abs=1e-6)
    assert resolve_failures(batch).keep == [i != 2 for i in range(8)] and batch.metrics.num_error == 1

    saved = save_image_reward_model(rm, tmp_path / "rm")
    again = image_rm_from_options({"path": str(saved)}, None, image_size=16)
    with torch.no_grad():
        assert again([a.prompt for a in asks], images).tolist() == pytest.approx(rm_scores, abs=1e-6)
    with pytest.raises(ValueError, match=r"is not a saved image reward model .* lacks \['clip', 'tokenizer'"):
        load_image_reward_model(tmp_path)
    with pytest.raises(ValueError, match=r"rewards\[1\]\.kind 'math_verify' is not an image reward"):
        check_image_specs([specs[0], RewardSpec(kind="math_verify")])
    with pytest.raises(ValueError, match=r"rewards\[0\]\.options: unknown \['size'\] for 'image_rm'"):
        check_image_specs([RewardSpec(kind="image_rm", options={"size": "3"})])
    with pytest.raises(ValueError, match=r"rewards is empty"):
        check_image_specs([])
    with pytest.raises(ValueError, match=r"kind 'image_rm' \(image_rm\) needs image_rm="):
        build_combined_images([RewardSpec(kind="image_rm")])
