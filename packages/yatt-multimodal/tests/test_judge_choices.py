"""Constrained verdicts (`JudgeSpec.choices`) through yatt-rollout's real HF engine on a tiny random judge:
with the choices every judgement is one of them and parses (parse rate 1.0); without them the same judge's
free text mostly states no verdict, and those failures are counted statuses, never a silent zero."""

import asyncio

import pytest

pytest.importorskip("torch")
hf_engine = pytest.importorskip("yatt_rollout.hf_engine")

from yatt_multimodal.genprm import GenPRM  # noqa: E402
from yatt_multimodal.genrm import GenRMJudge, judge_sampling  # noqa: E402
from yatt_multimodal.prompt_codecs import HFChatCodec  # noqa: E402
from yatt_multimodal.types import JudgeSpec, RewardRequest  # noqa: E402
from yatt_rollout.tiny import tiny_causal_lm, train_tokenizer  # noqa: E402

CORPUS = [
    f"{a} + {b} = {a + b}. Verdict: Yes. Verdict: No. Wrong steps: none" for a in range(20) for b in range(20)
]
VERDICTS = ["Verdict: Yes", "Verdict: No"]


@pytest.fixture(scope="module")
def judge():
    tok = train_tokenizer(CORPUS, vocab_size=400)
    engine = hf_engine.HFEngine(
        tiny_causal_lm(len(tok), seed=3, max_position_embeddings=512), tok, max_batch_size=64, seed=0
    )
    yield engine, tok
    engine.close()


def _requests(n: int = 8) -> list[RewardRequest]:
    return [
        RewardRequest(
            request_id=f"r{i}", prompt=f"{i} + 2 =", response=str(i + 2 + i % 2), reference=str(i + 2)
        )
        for i in range(n)
    ]


def test_choices_travel_to_the_engine_and_are_validated():
    spec = JudgeSpec(choices=VERDICTS)
    assert judge_sampling(spec, seed=1).choices == VERDICTS
    assert not judge_sampling(JudgeSpec()).choices  # unset: free text
    with pytest.raises(
        ValueError,
        match=r"^JudgeSpec.choices\[1\] 'maybe' states no verdict to the 'verify_yes_no' "
        r"template's parser$",
    ):
        GenRMJudge(engine=None, codec=None, spec=JudgeSpec(choices=["Verdict: Yes", "maybe"]))
    with pytest.raises(ValueError, match="choices must be non-empty strings"):
        JudgeSpec(choices=["Verdict: Yes", ""])


def test_constrained_judge_always_parses(judge):
    engine, tok = judge
    spec = JudgeSpec(num_samples=4, max_new_tokens=12, choices=VERDICTS, temperature=1.0, top_p=1.0)
    batch = asyncio.run(GenRMJudge(engine, HFChatCodec(tok), spec, seed=5).score(_requests()))
    assert [r.status for r in batch.rewards] == ["ok"] * 8
    assert batch.metrics.num_judgements == 32 and batch.metrics.num_unparsed_judgements == 0
    for reward in batch.rewards:
        assert reward.critique in VERDICTS
        assert reward.components["genrm/parsed"] == 1.0
        assert reward.score in (-1.0, -0.5, 0.0, 0.5, 1.0)


def test_free_text_failures_are_counted_statuses(judge):
    engine, tok = judge
    spec = JudgeSpec(num_samples=2, max_new_tokens=6, temperature=1.0, top_p=1.0)
    batch = asyncio.run(GenRMJudge(engine, HFChatCodec(tok), spec, seed=5).score(_requests()))
    failed = [r for r in batch.rewards if r.status == "parse_error"]
    assert failed and batch.metrics.num_parse_error == len(failed)
    assert all("no verdict" in r.error for r in failed)


def test_constrained_step_critic_always_parses(judge):
    engine, tok = judge
    spec = JudgeSpec(
        template_name="step_critique",
        num_samples=3,
        max_new_tokens=12,
        parser="yes_no",
        choices=["Wrong steps: none", "Wrong steps: 1"],
    )
    critiques = asyncio.run(GenPRM(engine, HFChatCodec(tok), spec, tokenizer=tok).critique(_requests(4)))
    assert [c.status for c in critiques] == ["ok"] * 4
    assert all(c.num_unparsed == 0 and len(c.wrong_steps) == 3 for c in critiques)
    assert {s for c in critiques for ws in c.wrong_steps for s in ws} <= {0}
