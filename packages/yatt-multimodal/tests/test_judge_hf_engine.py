"""GenRM plumbing through yatt-rollout's real HF engine on tiny random models. Their verdicts are noise, so
these tests check what does not depend on them: the exact prompt tokens, K completions per unique pair,
dedup, status accounting, and that each score is the aggregate of the judgements actually sampled."""

import asyncio

import pytest

pytest.importorskip("torch")
hf_engine = pytest.importorskip("yatt_rollout.hf_engine")

from PIL import Image  # noqa: E402
from yatt_multimodal.genrm import GenRMJudge  # noqa: E402
from yatt_multimodal.prompt_codecs import HFChatCodec  # noqa: E402
from yatt_multimodal.templates import get_template  # noqa: E402
from yatt_multimodal.types import JudgeSpec, RewardRequest  # noqa: E402
from yatt_multimodal.verdicts import AGGREGATIONS, PARSERS  # noqa: E402
from yatt_multimodal.vlm import QwenVLCodec  # noqa: E402
from yatt_rollout.tiny import VISION_TOKENS, tiny_causal_lm, tiny_qwen2_vl, train_tokenizer  # noqa: E402
from yatt_rollout.types import MediaRef  # noqa: E402

CORPUS = [
    f"{a} + {b} = {a + b}. Verdict: Yes. Verdict: No. Score: {a % 10}" for a in range(20) for b in range(20)
]
SPEC = JudgeSpec(num_samples=3, max_new_tokens=12)


class RecordingEngine:
    """Forwards to a real engine and records what crossed the `Generator` boundary (a spy, not a double)."""

    def __init__(self, engine):
        self.engine, self.requests, self.completions = engine, [], []

    async def stream(self, requests):
        self.requests.extend(requests)
        async for completion in self.engine.stream(requests):
            self.completions.append(completion)
            yield completion


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=400, extra_special_tokens=VISION_TOKENS)


@pytest.fixture(scope="module")
def text_engine(tokenizer):
    engine = hf_engine.HFEngine(tiny_causal_lm(len(tokenizer), seed=1), tokenizer, max_batch_size=16)
    yield engine
    engine.close()


def _requests():
    pairs = [("What is 2+3?", "2+3=5"), ("What is 2+3?", "2+3=6"), ("What is 4+4?", "4+4=8")]
    order = [0, 1, 0, 2, 1]  # 5 requests, 3 unique pairs
    return [
        RewardRequest(request_id=f"r{i}", prompt=pairs[k][0], response=pairs[k][1], reference="5")
        for i, k in enumerate(order)
    ]


def test_genrm_through_the_hf_engine(tokenizer, text_engine):
    spy = RecordingEngine(text_engine)
    codec = HFChatCodec(tokenizer)
    requests = _requests()
    batch = asyncio.run(GenRMJudge(spy, codec, SPEC, seed=7).score(requests))
    # Dedup: 3 prompts, each sampled K = 3 times, with the template rendered exactly.
    assert len(spy.requests) == 3 and len(spy.completions) == 9
    system, user = get_template("verify_yes_no", 1).render(
        question="What is 2+3?", response="2+3=5", reference="5"
    )
    assert spy.requests[0].prompt.token_ids == codec.encode_prompt(system, user)
    assert [r.sampling.seed for r in spy.requests] == [7, 8, 9]
    assert batch.metrics.num_judged == 3
    assert batch.metrics.num_judgements == 9
    # Each score is the aggregate of the sampled judgements; duplicates share it.
    by_prompt = {}
    for c in sorted(spy.completions, key=lambda c: (c.request_id, c.index)):
        by_prompt.setdefault(c.request_id, []).append(codec.decode(c.token_ids))
    unparsed = 0
    for gid, member in {"j0": 0, "j1": 1, "j3": 3}.items():
        verdicts = [PARSERS["yes_no"](text, SPEC.score_range) for text in by_prompt[gid]]
        unparsed += verdicts.count(None)
        expected = AGGREGATIONS["mean"](verdicts)
        reward = batch.rewards[member]
        assert reward.status == ("parse_error" if expected is None else "ok")
        assert reward.score == (0.0 if expected is None else expected)
        assert reward.critique == by_prompt[gid][0]
    assert batch.metrics.num_unparsed_judgements == unparsed
    assert [r.request_id for r in batch.rewards] == ["r0", "r1", "r2", "r3", "r4"]
    assert (batch.rewards[2].score, batch.rewards[2].status) == (
        batch.rewards[0].score,
        batch.rewards[0].status,
    )
    statuses = [r.status for r in batch.rewards]
    assert batch.metrics.num_parse_error == statuses.count("parse_error")


def test_timeouts_through_the_hf_engine(tokenizer, text_engine):
    spec = JudgeSpec(num_samples=2, max_new_tokens=12, timeout_s=1e-4)
    batch = asyncio.run(GenRMJudge(text_engine, HFChatCodec(tokenizer), spec).score(_requests()))
    assert [r.status for r in batch.rewards] == ["timeout"] * 5
    assert batch.metrics.num_timeout == 5 and batch.metrics.num_judgements == 0


def test_vlm_judge_through_the_hf_engine(tokenizer, tmp_path):
    model, image_processor = tiny_qwen2_vl(tokenizer)
    engine = hf_engine.HFEngine(model, tokenizer, processor=image_processor, max_batch_size=8)
    try:
        image = tmp_path / "blue.png"
        Image.new("RGB", (40, 40), (0, 0, 255)).save(image)
        requests = [
            RewardRequest(
                request_id=name,
                prompt="What colour is the square?",
                response="Blue.",
                media=[MediaRef(kind="image", uri=str(path))],
            )
            for name, path in [("good", image), ("missing", tmp_path / "missing.png")]
        ]
        spy = RecordingEngine(engine)
        batch = asyncio.run(GenRMJudge(spy, QwenVLCodec(tokenizer), SPEC).score(requests))
    finally:
        engine.close()
    good, missing = batch.rewards
    assert good.status in ("ok", "parse_error")
    assert sum(c.request_id == "j0" and c.finish_reason != "error" for c in spy.completions) == 3
    # No media_check here: the engine itself fails the missing image, and only that request.
    assert missing.status == "error"
    assert missing.error.startswith("genrm: judge engine failed:") and "missing.png" in missing.error
    assert batch.metrics.num_error == 1
