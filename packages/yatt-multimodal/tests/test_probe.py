"""The judge robustness probe through scripted judges: a gullible judge, a strict one, a one-token-fooled one."""

import asyncio
import math

import pytest
from yatt_multimodal.genrm import GenRMJudge
from yatt_multimodal.probe import MASTER_KEYS, ProbeItem, probe_judge
from yatt_multimodal.prompt_codecs import ByteCodec
from yatt_multimodal.testing import ScriptedJudgeEngine
from yatt_multimodal.types import JudgeSpec

ITEMS = [
    ProbeItem(question="What is 2+3?", reference="5", solution="2 + 3 = 5, so the answer is \\boxed{5}."),
    ProbeItem(question="What is 4*6?", reference="24", solution="4 * 6 = 24, so the answer is \\boxed{24}."),
]


def _solution(prompt: str) -> str:
    return prompt.split("Solution to grade:\n")[1].split("\n\nVerify the solution")[0]


def _judge(rule):
    engine = ScriptedJudgeEngine(
        lambda prompt, i: "Verdict: Yes" if rule(_solution(prompt)) else "Verdict: No"
    )
    return GenRMJudge(engine, ByteCodec(), JudgeSpec(num_samples=2))


def test_gullible_strict_and_one_token_judges():
    gullible = asyncio.run(probe_judge(_judge(lambda s: True), ITEMS))
    assert (gullible.false_positive_rate, gullible.num_probes, gullible.num_failed) == (1.0, 12, 0)
    strict = asyncio.run(probe_judge(_judge(lambda s: "\\boxed{" in s), ITEMS))
    assert strict.false_positive_rate == 0.0
    # Fooled by a lone ":" only: 2 of the 12 probes (one per item) are accepted -> 1/6.
    colon = asyncio.run(probe_judge(_judge(lambda s: s.strip() == ":"), ITEMS))
    assert colon.false_positive_rate == pytest.approx(1 / 6)
    assert colon.per_key == {key: (1.0 if key == "colon" else 0.0) for key in MASTER_KEYS}


def test_probe_counts_judge_failures_apart():
    mute = GenRMJudge(ScriptedJudgeEngine(lambda p, i: "no idea"), ByteCodec(), JudgeSpec(num_samples=1))
    report = asyncio.run(probe_judge(mute, ITEMS[:1], keys=["colon", "empty"]))
    assert (report.num_probes, report.num_failed) == (2, 2)
    assert math.isnan(report.false_positive_rate)


def test_probe_bad_arguments():
    with pytest.raises(ValueError, match=r"unknown keys \['magic'\]"):
        asyncio.run(probe_judge(_judge(lambda s: True), ITEMS, keys=["magic"]))
    with pytest.raises(ValueError, match="items is empty"):
        asyncio.run(probe_judge(_judge(lambda s: True), []))
