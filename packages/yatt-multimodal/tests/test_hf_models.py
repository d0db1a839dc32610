"""The parts that need a real tokenizer or model: GenPRM token spans through a trained BPE tokenizer, the
discriminative reward model (batched = one at a time), Qwen2-VL inputs through a tiny Qwen2-VL forward, and
the VLM judge failing only the requests whose image is missing or corrupt."""

import asyncio
import math
from functools import partial

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from yatt_multimodal.genprm import GENPRM_SPEC, GenPRM  # noqa: E402
from yatt_multimodal.genrm import GenRMJudge  # noqa: E402
from yatt_multimodal.media import load_image  # noqa: E402
from yatt_multimodal.prompt_codecs import ByteCodec, HFChatCodec  # noqa: E402
from yatt_multimodal.reward_model import SequenceClassifierReward  # noqa: E402
from yatt_multimodal.reward_specs import build_reward  # noqa: E402
from yatt_multimodal.testing import ScriptedJudgeEngine  # noqa: E402
from yatt_multimodal.types import JudgeSpec, MediaLimits, RewardRequest, RewardSpec  # noqa: E402
from yatt_multimodal.vlm import IMAGE_PAD, QwenVLCodec, expand_image_pads, qwen2_vl_inputs  # noqa: E402
from yatt_rollout.tiny import VISION_TOKENS, tiny_qwen2_vl, train_tokenizer  # noqa: E402
from yatt_rollout.types import MediaRef  # noqa: E402

CORPUS = [
    f"{a} + {b} = {a + b}\n\nso the answer is {a + b}. Verdict: Yes No" for a in range(20) for b in range(20)
]
RESPONSE = "a = 2\n\nb = 3\n\nso a + b = 5"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=400, extra_special_tokens=VISION_TOKENS)


def _genprm_engine():
    critiques = [
        "Wrong steps: 3",
        "Wrong steps: none",
        "I am not sure.",
        "Step 2 is wrong.\nWrong steps: 2, 3",
    ]
    return ScriptedJudgeEngine(lambda prompt, i: critiques[i])


def _step_texts(tokenizer, ids, spans):
    return [tokenizer.decode(ids[s:e]) for s, e in spans]


def test_genprm_wrong_step_sets_and_token_spans(tokenizer):
    ids = tokenizer(RESPONSE, add_special_tokens=False)["input_ids"]
    request = RewardRequest(
        request_id="r0", prompt="a=2, b=3; a+b?", response=RESPONSE, response_token_ids=ids
    )
    empty = RewardRequest(request_id="e", prompt="q", response="  ")
    engine = _genprm_engine()
    out, none = asyncio.run(GenPRM(engine, ByteCodec(), tokenizer=tokenizer).critique([request, empty]))
    # An empty response has no steps: nothing to critique, nothing sent, nothing wrong.
    assert (none.status, none.char_spans, none.wrong_steps, len(engine.requests)) == ("ok", [], [], 1)
    assert (out.status, out.wrong_steps, out.num_unparsed) == ("ok", [[2], [], [1, 2]], 1)
    assert out.char_spans == [(0, 5), (7, 12), (14, 26)]
    # Each step's token span decodes to the step text plus, at most, the whitespace tokens it touches.
    assert [t.strip() for t in _step_texts(tokenizer, ids, out.token_spans)] == [
        "a = 2",
        "b = 3",
        "so a + b = 5",
    ]
    assert out.token_spans[-1][1] == len(ids)
    assert engine.requests[0].sampling.n == GENPRM_SPEC.num_samples == 4
    assert (
        "3 numbered steps:\nStep 1: a = 2\n\nStep 2: b = 3\n\nStep 3: so a + b = 5"
        in engine.prompt_texts()[0]
    )


def test_genprm_maps_a_non_canonical_tokenization(tokenizer):
    # A policy may sample a tokenization that re-tokenizing would not give: here one token per character.
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch)[0]) for ch in RESPONSE]
    assert ids != tokenizer(RESPONSE, add_special_tokens=False)["input_ids"]
    request = RewardRequest(request_id="r1", prompt="q", response=RESPONSE, response_token_ids=ids)
    [out] = asyncio.run(GenPRM(_genprm_engine(), ByteCodec(), tokenizer=tokenizer).critique([request]))
    assert out.token_spans == [(0, 5), (7, 12), (14, 26)]  # one token per char: token spans = char spans
    bad = RewardRequest(request_id="r2", prompt="q", response=RESPONSE, response_token_ids=ids[:-1])
    [out] = asyncio.run(GenPRM(_genprm_engine(), ByteCodec(), tokenizer=tokenizer).critique([bad]))
    assert (out.status, out.error) == (
        "error",
        "request r2: response_token_ids do not decode to the response text; cannot map steps to tokens",
    )


@pytest.fixture(scope="module")
def reward_model(tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForSequenceClassification(config).float().eval()


def test_reward_model_batched_equals_one_at_a_time(tokenizer, reward_model):
    requests = [
        RewardRequest(
            request_id=f"r{i}", prompt=f"What is {i} + {i}?", response=f"{i} + {i} = {2 * i}" * (i % 3 + 1)
        )
        for i in range(7)
    ]
    rm = SequenceClassifierReward(reward_model, tokenizer, batch_size=3)
    batched = asyncio.run(rm.score(requests)).rewards
    single = [rm.score_sync([r]).rewards[0].score for r in requests]
    assert [r.score for r in batched] == pytest.approx(single, abs=1e-5)
    assert len({round(s, 6) for s in single}) == 7  # distinct inputs, distinct scores: the test can fail
    # The reference value of request 0: the model's logit at the last token of the unpadded sequence.
    ids = torch.tensor([rm.encode(requests[0])])
    with torch.inference_mode():
        expected = reward_model(input_ids=ids).logits[0, 0].item()
    assert batched[0].score == pytest.approx(expected, abs=1e-5)
    spec = RewardSpec(kind="reward_model", options={"batch_size": "2", "sigmoid": "true"})
    built = build_reward(spec, rm_model=reward_model, rm_tokenizer=tokenizer)
    sig = [r.score for r in built.score_sync(requests).rewards]
    assert sig == pytest.approx([1 / (1 + math.exp(-s)) for s in single], abs=1e-6)
    short = SequenceClassifierReward(reward_model, tokenizer, max_length=8, sigmoid=True)
    out = short.score_sync([requests[0]]).rewards[0]
    assert out.status == "error"
    assert out.error.endswith("tokens, outside 1..max_length=8")


@pytest.fixture(scope="module")
def vl(tokenizer):
    return tiny_qwen2_vl(tokenizer)


def test_qwen2_vl_inputs_run_a_forward(tokenizer, vl):
    model, image_processor = vl
    prompt = QwenVLCodec(tokenizer).encode_prompt("system", "Is the square red?", num_images=1)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert prompt.count(pad) == 1  # the engine's convention: one placeholder per image
    image = Image.new("RGB", (50, 40), (255, 0, 0))
    inputs = qwen2_vl_inputs(tokenizer, image_processor, prompt, [image])
    grid = inputs["image_grid_thw"]
    num_image_tokens = int(grid.prod()) // image_processor.merge_size**2
    assert int((inputs["input_ids"] == pad).sum()) == num_image_tokens
    assert torch.equal(inputs["mm_token_type_ids"], (inputs["input_ids"] == pad).long())
    with torch.inference_mode():
        logits = model(**inputs).logits
    assert logits.shape == (1, len(prompt) - 1 + num_image_tokens, model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"prompt has 1 image placeholder\(s\) but 2 image\(s\) were given"):
        expand_image_pads(prompt, pad, [4, 4])


def test_vlm_judge_fails_only_the_bad_images(tokenizer, tmp_path):
    good, corrupt = tmp_path / "good.png", tmp_path / "corrupt.png"
    Image.new("RGB", (8, 8), (0, 0, 255)).save(good)
    corrupt.write_bytes(good.read_bytes()[:30])
    codec = QwenVLCodec(tokenizer)
    engine = ScriptedJudgeEngine(lambda prompt, i: "Verdict: Yes", codec=codec)
    check = partial(load_image, limits=MediaLimits(max_pixels=64 * 64))
    judge = GenRMJudge(engine, codec, JudgeSpec(num_samples=2), media_check=check)
    requests = [
        RewardRequest(
            request_id=name,
            prompt="Is it blue?",
            response="Yes.",
            media=[MediaRef(kind="image", uri=str(path))],
        )
        for name, path in [("good", good), ("missing", tmp_path / "missing.png"), ("corrupt", corrupt)]
    ]
    batch = asyncio.run(judge.score(requests))
    assert [(r.request_id, r.status, r.score) for r in batch.rewards] == [
        ("good", "ok", 1.0),
        ("missing", "error", 0.0),
        ("corrupt", "error", 0.0),
    ]
    assert "missing.png': file not found" in batch.rewards[1].error
    assert "corrupt.png': not a readable image" in batch.rewards[2].error
    assert (batch.metrics.num_judged, batch.metrics.num_error) == (1, 2)
    [sent] = engine.requests
    assert sent.prompt.media == requests[0].media
    assert sent.prompt.token_ids.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD)) == 1


def test_hf_chat_codec_uses_the_chat_template(tokenizer):
    ids = HFChatCodec(tokenizer).encode_prompt("sys", "user text")
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nuser text<|im_end|>\n<|im_start|>assistant\n"
    )
