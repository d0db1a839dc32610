"""The torch policy learner on a vision-language policy (a tiny Qwen2-VL built from a config): per-row image
inputs travel beside the [B, T] fields, survive micro-batching, and give the logprobs of a plain one-row
forward; an update moves the vision tower (gradients flow through the pixels)."""

import pytest
import torch
from yatt_algos.learner.packing import as_batch, select
from yatt_algos.learner.torch_backend import TorchPolicyLearner, vision_kwargs
from yatt_algos.types import AlgoConfig, OptimConfig

pytest.importorskip("transformers", reason="the tiny test models are HF models")

IMAGE, START, END = 120, 121, 122  # image pad, vision start, vision end ids in the 128-token vocabulary
PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch^2
GRID = (1, 4, 4)  # one 56x56 frame: 16 patches, merged 2x2 into 4 image tokens


def _tiny_vlm(seed: int = 0):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4]},
    }
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=123,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).float()


def _row(num_images: int, g: torch.Generator) -> list[int]:
    """Text, then each image as start + 4 pads + end, then text (a 'response')."""
    ids = torch.randint(1, 100, (3,), generator=g).tolist()
    for _ in range(num_images):
        ids += [START] + [IMAGE] * 4 + [END]
    return ids + torch.randint(1, 100, (5,), generator=g).tolist()


@pytest.fixture(scope="module")
def vlm_batch():
    """3 rows with 1, 0 and 2 images, right padded; per-row pixels padded to 32 patches, grids to 2 images."""
    g = torch.Generator().manual_seed(0)
    rows = [_row(n, g) for n in (1, 0, 2)]
    width = max(map(len, rows))
    ids = torch.zeros(3, width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    attention = ids != 0
    pixels = torch.zeros(3, 32, PATCH_DIM)
    grids = torch.zeros(3, 2, 3, dtype=torch.long)
    for b, n in enumerate((1, 0, 2)):
        pixels[b, : 16 * n] = torch.randn(16 * n, PATCH_DIM, generator=g)
        grids[b, :n] = torch.tensor(GRID)
    lengths = torch.tensor([len(r) for r in rows])[:, None]
    response = attention & (torch.arange(width)[None] >= lengths - 5)  # each row's last 5 tokens
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "response_mask": response,
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": pixels,
        "image_grid_thw": grids,
        "rows": rows,
    }


def _plain_logprobs(model, ids: list[int], pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """One unpadded row through the model's own flat VLM interface; log p(ids[t] | ids[:t]), 0 at t = 0."""
    x = torch.tensor([ids])
    kwargs = {"mm_token_type_ids": (x == IMAGE).long()}
    if len(grids):
        kwargs |= {"pixel_values": pixels, "image_grid_thw": grids}
    logits = model(input_ids=x, attention_mask=torch.ones_like(x), **kwargs).logits[0, :-1]
    picked = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


def test_vision_kwargs_flatten_rows_in_order(vlm_batch):
    batch = {k: v for k, v in vlm_batch.items() if k != "rows"}
    out = vision_kwargs(batch)
    # 1 + 0 + 2 images of 16 patches each: 48 patches, 3 grids, row 0's patches first, then row 2's
    assert out["pixel_values"].shape == (48, PATCH_DIM)
    assert out["image_grid_thw"].tolist() == [list(GRID)] * 3
    assert torch.equal(out["pixel_values"][:16], batch["pixel_values"][0, :16])
    assert torch.equal(out["pixel_values"][16:], batch["pixel_values"][2, :32])
    # the text-only row alone: no pixels at all, only the token types
    assert set(vision_kwargs(select(as_batch(batch), [1], 8))) == {"mm_token_type_ids"}


def test_per_row_fields_are_checked_and_kept_whole(vlm_batch):
    batch = as_batch({k: v for k, v in vlm_batch.items() if k != "rows"})
    picked = select(batch, [2, 0], max_len=5)
    assert picked["input_ids"].shape == (2, 5) and picked["mm_token_type_ids"].shape == (2, 5)
    assert picked["pixel_values"].shape == (2, 32, PATCH_DIM)  # per-row fields are not cut to t
    assert picked["image_grid_thw"].shape == (2, 2, 3)
    with pytest.raises(
        ValueError, match=r"pixel_values has shape \(2, 32, 1176\), expected \(3, \.\.\.\) rows"
    ):
        as_batch({**batch, "pixel_values": batch["pixel_values"][:2]})
    with pytest.raises(ValueError, match=r"group_ids has shape \(3, 2\), expected \(3,\)"):
        as_batch({**batch, "group_ids": torch.zeros(3, 2, dtype=torch.long)})


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_logprobs_match_a_plain_forward_per_row(vlm_batch, micro_batch_size):
    model = _tiny_vlm()
    learner = TorchPolicyLearner(model, algo=AlgoConfig(), optim_config=None)
    learner.micro_batch_size = micro_batch_size
    batch = {k: v for k, v in vlm_batch.items() if k != "rows"}
    got = learner.compute_logprobs(batch)
    for b, ids in enumerate(vlm_batch["rows"]):
        n = int((batch["image_grid_thw"][b].prod(-1) > 0).sum())
        with torch.no_grad():
            want = _plain_logprobs(
                model, ids, batch["pixel_values"][b, : 16 * n], batch["image_grid_thw"][b, :n]
            )
        torch.testing.assert_close(got[b, : len(ids)], want, atol=1e-5, rtol=1e-5)
        assert torch.all(got[b, len(ids) :] == 0)


def test_update_trains_the_vision_tower(vlm_batch):
    model = _tiny_vlm()
    learner = TorchPolicyLearner(
        model, algo=AlgoConfig(), optim_config=OptimConfig(lr=1e-2, micro_batch_size=2, clip_grad_norm=0.0)
    )
    batch = {k: v for k, v in vlm_batch.items() if k != "rows"}
    old = learner.compute_logprobs(batch)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if "visual" in k}
    adv = torch.where(batch["response_mask"], torch.tensor([1.0, -1.0, 0.5])[:, None], 0.0)
    stats = learner.update({**batch, "old_logprobs": old, "advantages": adv})
    # ratio 1 everywhere on the first update: the PPO loss is -mean(A) over the 15 response tokens
    # = -(5 * 1.0 - 5 * 1.0 + 5 * 0.5) / 15 = -1/6
    assert stats.loss == pytest.approx(-1 / 6, abs=1e-5)
    moved = [k for k, v in model.named_parameters() if "visual" in k and not torch.equal(v, before[k])]
    assert moved, "no vision-tower parameter changed: pixels did not reach the loss"
