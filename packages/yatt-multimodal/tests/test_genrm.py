"""GenRM through the scripted judge double: templates, verdict parsing, aggregation, dedup, timeouts, engine
failures and the failure policy, all with hand-worked numbers."""

import asyncio

import pytest
from yatt_multimodal.genrm import GenRMJudge
from yatt_multimodal.prompt_codecs import ByteCodec
from yatt_multimodal.reward_specs import build_combined, build_reward
from yatt_multimodal.rewards import RewardStepFailed, resolve_failures, score_stream
from yatt_multimodal.templates import get_template
from yatt_multimodal.testing import FAIL, ScriptedJudgeEngine
from yatt_multimodal.types import JudgeSpec, RewardRequest, RewardSpec
from yatt_multimodal.verdicts import aggregate_majority, aggregate_mean, parse_json, parse_score, parse_yes_no

# Per response tag, the K = 4 judgements the double answers with.
SCRIPT = {
    "GOOD": ["Step 1 ok.\nVerdict: Yes"] * 4,
    "BAD": ["Verdict: No"] * 4,
    # yes, yes, no, no verdict -> mean (1 + 1 - 1 + 0) / 4 = 0.25; majority: 2 yes vs 1 no -> +1.0
    "MIXED": ["Verdict: Yes", "Verdict: **yes**", "Verdict: No", "I cannot decide."],
    "MUTE": ["Looks fine to me."] * 4,
    "BROKEN": [FAIL] * 4,
    "SLOW": ["Verdict: Yes"] * 4,
}


def _script(prompt: str, index: int) -> str:
    solution = prompt.split("Solution to grade:\n")[1]
    tag = next(t for t in SCRIPT if solution.startswith(t))
    return SCRIPT[tag][index]


def _engine(**kwargs):
    slow = lambda prompt: 30.0 if "Solution to grade:\nSLOW" in prompt else 0.0  # noqa: E731
    return ScriptedJudgeEngine(_script, delay_s=slow, **kwargs)


def _req(tag, rid=None, prompt="What is 2+3?", reference="5"):
    return RewardRequest(request_id=rid or tag, prompt=prompt, response=f"{tag}: 2+3=5", reference=reference)


def _judge(engine, **spec):
    return GenRMJudge(engine, ByteCodec(), JudgeSpec(num_samples=4, **spec))


def test_parsers_worked_by_hand():
    assert parse_yes_no("Verdict: No ... on reflection, Verdict: Yes") == -1.0  # the first verdict counts
    assert parse_yes_no("verdict:no") == -1.0
    assert parse_yes_no("\\boxed{Yes}") == 1.0
    assert parse_yes_no("Yes, I think so") is None  # no verdict phrase
    assert parse_score("Score: 7", (0.0, 10.0)) == pytest.approx(0.4)  # 2 * 7 / 10 - 1
    assert parse_score("Score: 3", (1.0, 5.0)) == 0.0  # 2 * (3 - 1) / 4 - 1
    assert parse_score("Score: 11", (0.0, 10.0)) is None  # out of range is no verdict
    assert parse_json('thinking {"a": 1} then {"verdict": "no"}') == -1.0
    assert parse_json('{"correct": true}') == 1.0
    assert parse_json('{"score": 2.5}', (0.0, 5.0)) == 0.0
    assert parse_json("{not json}") is None
    assert aggregate_mean([1.0, None, -1.0, 1.0]) == 0.25
    assert aggregate_mean([None, None]) is None
    assert aggregate_majority([1.0, -1.0, None]) == 0.0  # a 1:1 tie
    assert aggregate_majority([0.4, 0.4, -1.0]) == 0.4


def test_template_renders_question_response_and_reference():
    engine = _engine()
    asyncio.run(_judge(engine).score([_req("GOOD"), _req("BAD", reference="")]))
    system, user = get_template("verify_yes_no", 1).render(
        question="What is 2+3?", response="GOOD: 2+3=5", reference="5"
    )
    assert engine.prompt_texts()[0] == f"{system}\n\n{user}\n"
    assert "Expected answer: 5\n\nSolution to grade:\nGOOD: 2+3=5" in user
    assert "Expected answer" not in engine.prompt_texts()[1]  # no reference, no block
    sampling = engine.requests[0].sampling
    assert (sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (4, 0.7, 0.9, 512)


@pytest.mark.parametrize(
    ("aggregation", "expected"), [("mean", [1.0, -1.0, 0.25]), ("majority", [1.0, -1.0, 1.0])]
)
def test_verdicts_and_aggregation(aggregation, expected):
    batch = asyncio.run(
        _judge(_engine(), aggregation=aggregation).score([_req(t) for t in ("GOOD", "BAD", "MIXED")])
    )
    assert [r.score for r in batch.rewards] == expected
    assert [r.status for r in batch.rewards] == ["ok"] * 3
    assert batch.rewards[2].components == {"genrm": expected[2], "genrm/parsed": 0.75}
    assert batch.rewards[0].critique == "Step 1 ok.\nVerdict: Yes"
    assert (batch.metrics.num_judgements, batch.metrics.num_unparsed_judgements) == (12, 1)


def test_dedup_judges_each_unique_pair_once():
    # 7 requests, 3 unique (prompt, response, reference) tuples: GOOD x3, BAD x2, GOOD with another prompt x2.
    requests = [_req("GOOD", "a"), _req("BAD", "b"), _req("GOOD", "c"), _req("BAD", "d"), _req("GOOD", "e")]
    requests += [_req("GOOD", "f", prompt="What is 3+2?"), _req("GOOD", "g", prompt="What is 3+2?")]
    engine = _engine()
    batch = asyncio.run(_judge(engine).score(requests))
    assert len(engine.requests) == 3
    assert [r.request_id for r in batch.rewards] == list("abcdefg")
    assert [r.score for r in batch.rewards] == [1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
    assert (batch.metrics.num_requests, batch.metrics.num_judged, batch.metrics.num_judgements) == (7, 3, 12)
    undeduped = _engine()
    asyncio.run(_judge(undeduped, dedup=False).score(requests))
    assert len(undeduped.requests) == 7


def test_concurrency_limit_chunks_the_prompts():
    engine = _engine()
    asyncio.run(_judge(engine, max_concurrency=2).score([_req("GOOD", prompt=f"q{i}") for i in range(5)]))
    assert engine.call_sizes == [2, 2, 1]


def test_parse_errors_timeouts_and_engine_failures_are_counted():
    engine = _engine()
    judge = _judge(engine, timeout_s=0.3, on_parse_error="drop", on_timeout="zero")
    batch = asyncio.run(judge.score([_req(t) for t in ("GOOD", "MUTE", "SLOW", "BROKEN")]))
    assert [(r.status, r.score) for r in batch.rewards] == [
        ("ok", 1.0),
        ("parse_error", 0.0),
        ("timeout", 0.0),
        ("error", 0.0),
    ]
    assert batch.rewards[1].error == "genrm: no verdict in any of 4 judgements"
    assert batch.rewards[1].critique == "Looks fine to me."
    assert batch.rewards[2].error == "genrm: judge gave 0 of 4 judgements within 0.3s"
    assert batch.rewards[3].error == "genrm: judge engine failed: scripted failure"
    m = batch.metrics
    assert (m.num_parse_error, m.num_timeout, m.num_error, m.num_unparsed_judgements) == (1, 1, 1, 4)
    resolved = resolve_failures(batch, judge.failure_policy)
    assert resolved.keep == [True, False, True, False]  # parse error dropped, timeout zeroed, error dropped
    assert resolved.scores == [1.0, 0.0, 0.0, 0.0]
    assert resolved.metrics.num_dropped == 2
    strict = _judge(_engine(), on_parse_error="fail")
    with pytest.raises(RewardStepFailed, match="MUTE: parse_error"):
        resolve_failures(asyncio.run(strict.score([_req("MUTE")])), strict.failure_policy)


def test_score_and_json_parsers_through_the_judge():
    engine = ScriptedJudgeEngine(lambda prompt, i: f"Score: {i + 1}" if "from 1 to 5" in prompt else "")
    spec = JudgeSpec(num_samples=4, template_name="score", parser="score", score_range=(1.0, 5.0))
    batch = asyncio.run(GenRMJudge(engine, ByteCodec(), spec).score([_req("GOOD")]))
    # scores 1, 2, 3, 4 on [1, 5] -> -1, -0.5, 0, 0.5 -> mean -0.25
    assert batch.rewards[0].score == -0.25
    engine = ScriptedJudgeEngine(lambda prompt, i: '{"verdict": "yes"}' if i else "{}")
    spec = JudgeSpec(num_samples=2, template_name="json", parser="json")
    assert asyncio.run(GenRMJudge(engine, ByteCodec(), spec).score([_req("GOOD")])).rewards[0].score == 0.5


def test_judge_config_errors():
    with pytest.raises(ValueError, match=r"JudgeSpec\.parser 'score' does not read template verify_yes_no@1"):
        GenRMJudge(_engine(), ByteCodec(), JudgeSpec(parser="score"))
    with pytest.raises(ValueError, match="verify_yes_no@7 is not registered; known: json@1"):
        GenRMJudge(_engine(), ByteCodec(), JudgeSpec(template_version=7))


def test_combined_rule_and_genrm_from_specs():
    specs = [
        RewardSpec(kind="math_verify", options={"backend": "sympy"}),
        RewardSpec(kind="genrm", weight=0.5, judge=JudgeSpec(num_samples=4)),
    ]
    reward = build_combined(specs, engine=_engine(), codec=ByteCodec())
    requests = [_req("GOOD"), _req("MIXED"), _req("MUTE")]  # responses "<tag>: 2+3=5", reference 5
    batch = asyncio.run(reward.score(requests))
    # GOOD: 1 * 1 (math) + 0.5 * 1.0 = 1.5; MIXED: 1 + 0.5 * 0.25 = 1.125; MUTE: the judge's parse error.
    assert [r.score for r in batch.rewards[:2]] == [1.5, 1.125]
    assert batch.rewards[1].components == {"math_verify": 1.0, "genrm": 0.25, "genrm/parsed": 0.75}
    assert (batch.rewards[2].status, batch.rewards[2].error) == (
        "parse_error",
        "genrm: no verdict in any of 4 judgements",
    )
    assert (batch.metrics.num_judged, batch.metrics.num_judgements, batch.metrics.num_parse_error) == (
        3,
        12,
        1,
    )
    # The judge's policy (parse errors "zero" by default) is the combined one; MUTE keeps its math term:
    # 1 * 1 + 0.5 * 0 = 1.0. A stricter judge makes the combined policy stricter.
    resolved = resolve_failures(batch, reward.failure_policy)
    assert (resolved.scores, resolved.keep) == ([1.5, 1.125, 1.0], [True, True, True])
    strict = [specs[0], RewardSpec(kind="genrm", judge=JudgeSpec(num_samples=4, on_parse_error="drop"))]
    assert build_combined(strict, engine=_engine(), codec=ByteCodec()).failure_policy["parse_error"] == "drop"
    with pytest.raises(ValueError, match=r"RewardSpec kind 'genrm' \(judge\) needs engine=\.\.\."):
        build_reward(RewardSpec(kind="genrm", name="judge"), codec=ByteCodec())
    with pytest.raises(ValueError, match=r"RewardSpec\.kind 'oracle' is not registered"):
        build_reward(RewardSpec(kind="oracle"))
    # a seed resource makes the judge's sampling reproducible: call i of a batch samples from seed + i
    assert build_reward(RewardSpec(kind="genrm"), engine=_engine(), codec=ByteCodec(), seed=7).seed == 7
    assert build_reward(RewardSpec(kind="genrm"), engine=_engine(), codec=ByteCodec()).seed is None


async def _collect(stream):
    return [batch async for batch in stream]


def test_score_stream_judges_requests_as_they_arrive():
    async def all_at_once():
        for i, tag in enumerate(["GOOD", "BAD", "GOOD", "BAD", "GOOD", "MIXED"]):
            yield _req(tag, rid=f"s{i}")

    engine = _engine()
    batches = asyncio.run(_collect(score_stream(_judge(engine), all_at_once(), max_batch=4)))
    # All six are waiting when the first batch forms: batches of 4 and 2, dedup within each batch
    # (GOOD, BAD in the first; GOOD, MIXED in the second) -> 4 judge prompts.
    assert [len(b.rewards) for b in batches] == [4, 2]
    assert [r.score for b in batches for r in b.rewards] == [1.0, -1.0, 1.0, -1.0, 1.0, 0.25]
    assert [r.request_id for b in batches for r in b.rewards] == [f"s{i}" for i in range(6)]
    assert len(engine.requests) == 4

    async def trickle():
        for i in range(3):
            await asyncio.sleep(0.2)  # a slow rollout: every sample arrives after the batch window
            yield _req("GOOD", rid=f"t{i}")

    batches = asyncio.run(_collect(score_stream(_judge(_engine()), trickle(), max_batch=4, max_wait_s=0.01)))
    assert [r.request_id for b in batches for r in b.rewards] == ["t0", "t1", "t2"]
    assert all(len(b.rewards) <= 4 for b in batches)

    async def broken():
        yield _req("GOOD", rid="b0")
        raise RuntimeError("rollout replica died")

    with pytest.raises(RuntimeError, match="rollout replica died"):
        asyncio.run(_collect(score_stream(_judge(_engine()), broken())))
