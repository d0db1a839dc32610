"""`TRLReward`: TRL's reward-function calling convention in, scores out, with hand-worked values; statuses
logged and the failure policy applied (zero, drop as None, fail raises). The judge is the scripted double;
`tests/test_examples.py::test_trl_judge` runs the adapter inside a real `trl.GRPOTrainer`."""

import asyncio
import logging
from types import SimpleNamespace

import pytest
from yatt_multimodal.prompt_codecs import ByteCodec
from yatt_multimodal.rewards import RewardStepFailed, RuleReward
from yatt_multimodal.testing import ScriptedJudgeEngine
from yatt_multimodal.trl_adapter import TRLReward, message_text, trl_reward
from yatt_multimodal.types import JudgeSpec, RewardSpec

RULES = [
    RewardSpec(kind="exact_match", weight=1.0),
    RewardSpec(kind="regex", name="format", weight=0.5, options={"pattern": r"^\s*-?\d+"}),
]
JUDGE = RewardSpec(kind="genrm", weight=0.25, judge=JudgeSpec(num_samples=2, on_parse_error="zero"))


def _judge_script(prompt: str, index: int) -> str:
    # "12" is judged correct twice; "13" gets one "No" and one judgement without a verdict; anything else
    # gets no verdict at all (a parse error)
    solution = prompt.split("Solution to grade:\n")[1]
    if solution.startswith("12"):
        return "Verdict: Yes"
    if solution.startswith("13"):
        return ["Verdict: No", "hmm"][index]
    return "I cannot tell."


class Recorder:
    def __init__(self):
        self.metrics, self.extra = [], []

    def log_metric(self, name, value):
        self.metrics.append((name, value))

    def log_extra(self, column, values):
        self.extra.append((column, values))


def _call(reward, completions, answers, recorder=None, **kwargs):
    recorder = recorder or Recorder()
    prompts = [[{"role": "user", "content": "What is 5 + 7?"}]] * len(completions)
    conversational = [[{"role": "assistant", "content": c}] for c in completions]
    return reward(
        prompts=prompts,
        completions=conversational,
        completion_ids=[[1, 2]] * len(completions),
        answer=answers,
        log_metric=recorder.log_metric,
        log_extra=recorder.log_extra,
        trainer_state=SimpleNamespace(global_step=3),
        **kwargs,
    )


def test_rules_and_judge_give_hand_worked_scores_and_log_statuses(caplog):
    engine = ScriptedJudgeEngine(_judge_script)
    reward = trl_reward([*RULES, JUDGE], engine=engine, codec=ByteCodec(), name="yatt")
    assert reward.__name__ == "yatt"
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="yatt_multimodal.trl_adapter"):
        scores = _call(reward, ["12", "13", "twelve", " 12"], ["12"] * 4, recorder)
    # "12":     exact 1 + 0.5 * format 1 + 0.25 * judge mean(+1, +1) = 1.75
    # "13":     exact 0 + 0.5 * 1 + 0.25 * mean(-1, no verdict -> 0) = 0.5 - 0.125 = 0.375
    # "twelve": exact 0 + format 0; the judge states no verdict: parse_error, policy "zero" -> 0.0
    # " 12":    exact 1 (normalised) + 0.5 * format 1 = 1.5; the judge (script keyed on "12" at the start)
    #           states no verdict: parse_error, and "zero" keeps the terms that did score
    assert scores == [1.75, 0.375, 0.0, 1.5]
    call = reward.calls[-1]
    assert call.step == 3 and [r.request_id for r in call.requests] == ["3-0", "3-1", "3-2", "3-3"]
    assert call.requests[0].prompt == "What is 5 + 7?" and call.requests[0].reference == "12"
    assert call.requests[0].response_token_ids == [1, 2]
    assert [r.status for r in call.batch.rewards] == ["ok", "ok", "parse_error", "parse_error"]
    assert call.scores == scores
    assert recorder.metrics == [("yatt/parse_error", 2.0), ("yatt/timeout", 0.0), ("yatt/error", 0.0)]
    assert recorder.extra == [("yatt/status", ["ok", "ok", "parse_error", "parse_error"])]
    assert "yatt: 2 of 4 completions not scored ok {'parse_error': 2}" in caplog.text
    assert "3-2: parse_error (genrm:" in caplog.text


def _flaky(request):
    if request.response == "boom":
        raise RuntimeError("cannot parse 'boom'")
    return float(request.response == request.reference)


def test_failure_policy_zero_drop_and_fail():
    def adapter(policy=None):
        return TRLReward(RuleReward("flaky", _flaky), policy=policy)

    completions, answers = ["12", "boom", "7"], ["12", "12", "7"]
    # the default policy drops errors: None, which TRL reads as "not scorable", never a silent 0.0
    assert _call(adapter(), completions, answers) == [1.0, None, 1.0]
    assert _call(adapter({"error": "zero"}), completions, answers) == [1.0, 0.0, 1.0]
    with pytest.raises(
        RewardStepFailed, match=r"1 reward\(s\) failed with policy 'fail': 3-1: error \(flaky: "
    ):
        _call(adapter({"error": "fail"}), completions, answers)


def test_plain_strings_no_reference_and_a_running_event_loop():
    reward = TRLReward(RuleReward("digits", lambda r: float(r.response.isdigit())), reference_column=None)

    async def inside_a_loop():  # e.g. a notebook: the adapter still scores synchronously
        return reward(prompts=["a", "b"], completions=["42", "x"])

    assert asyncio.run(inside_a_loop()) == [1.0, 0.0]
    assert [r.reference for r in reward.calls[-1].requests] == ["", ""]
    assert reward.calls[-1].step == 0  # no trainer_state: calls are numbered


def test_bad_input_names_the_problem():
    reward = TRLReward(RuleReward("digits", lambda r: 1.0))
    with pytest.raises(ValueError, match=r"the dataset has no column 'answer' .*columns: \['solution'\]"):
        reward(prompts=["a"], completions=["1"], solution=["1"])
    with pytest.raises(ValueError, match="TRLReward: 2 prompts but 1 completions"):
        reward(prompts=["a", "b"], completions=["1"], answer=["1"])
    with pytest.raises(ValueError, match="expected a string or a list of chat messages, got int"):
        message_text(7)
    with pytest.raises(ValueError, match="name must be non-empty"):
        TRLReward(RuleReward("digits", lambda r: 1.0), name="")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    assert message_text(parts) == "What is shown?"
