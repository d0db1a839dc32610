"""HFEngine with a tiny Qwen2-VL: image prompts (placeholder expansion, mm_token_type_ids, M-RoPE) match
the model's own `generate`, mixed with text prompts in one left-padded batch; a missing image fails alone."""

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from yatt_rollout.hf_engine import HFEngine  # noqa: E402
from yatt_rollout.media import expand_image_tokens  # noqa: E402
from yatt_rollout.tiny import VISION_TOKENS, tiny_qwen2_vl, train_tokenizer  # noqa: E402
from yatt_rollout.types import GenerateRequest, MediaRef, Prompt, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = train_tokenizer(
        [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], extra_special_tokens=VISION_TOKENS
    )
    model, image_processor = tiny_qwen2_vl(tok)
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, size in enumerate([(50, 60), (40, 80)]):  # (width, height): different grids per image
        pixels = (np.random.RandomState(i).rand(size[1], size[0], 3) * 255).astype("uint8")
        paths.append(folder / f"img{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    engine = HFEngine(model, tok, processor=image_processor)
    yield tok, model, image_processor, engine, paths
    engine.close()


def _reference(model, image_processor, tok, req):
    """The model's own greedy `generate` on one unpadded prompt, images expanded as the processor does."""
    ids, kwargs = list(req.prompt.token_ids), {}
    if req.prompt.media:
        images = [Image.open(m.uri.removeprefix("file://")).convert("RGB") for m in req.prompt.media]
        kwargs = dict(image_processor(images=images, return_tensors="pt"))
        counts = [int(g.prod()) // image_processor.merge_size**2 for g in kwargs["image_grid_thw"]]
        ids = expand_image_tokens(ids, model.config.image_token_id, counts)
    t = torch.tensor([ids])
    out = model.generate(
        input_ids=t,
        attention_mask=torch.ones_like(t),
        mm_token_type_ids=(t == model.config.image_token_id).long(),
        max_new_tokens=req.sampling.max_new_tokens,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )
    return out[0, t.shape[1] :].tolist()


def test_image_prompts_generate_like_the_model(setup):
    tok, model, image_processor, engine, paths = setup
    image = tok.encode("<|vision_start|><|image_pad|><|vision_end|>")
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    reqs = [
        GenerateRequest(
            request_id="one",
            prompt=Prompt(
                token_ids=image + tok.encode("1 + 2 ="), media=[MediaRef(kind="image", uri=str(paths[0]))]
            ),
            sampling=greedy,
        ),
        GenerateRequest(
            request_id="two",
            prompt=Prompt(
                token_ids=tok.encode("3 =") + image + image,
                media=[
                    MediaRef(kind="image", uri=f"file://{paths[1]}"),
                    MediaRef(kind="image", uri=str(paths[0])),
                ],
            ),
            sampling=greedy,
        ),
        GenerateRequest(
            request_id="text",  # stops first: its row leaves the batch, the image rows go on
            prompt=Prompt(token_ids=tok.encode("12 + 30 =")),
            sampling=SamplingParams(temperature=0, max_new_tokens=2),
        ),
        GenerateRequest(
            request_id="missing",
            prompt=Prompt(
                token_ids=image, media=[MediaRef(kind="image", uri=str(paths[0].parent / "nope.png"))]
            ),
        ),
    ]
    out = engine.generate(reqs)
    for req, c in zip(reqs[:3], out[:3], strict=True):
        assert c.token_ids == _reference(model, image_processor, tok, req), req.request_id
        assert len(c.logprobs) == req.sampling.max_new_tokens and c.finish_reason == "length"
    assert out[3].finish_reason == "error"
    assert out[3].error == f"request missing: image file not found: {paths[0].parent / 'nope.png'}"
    assert engine.recent_batches[-1] == ["one", "text", "two"]  # one batch: images and text together
