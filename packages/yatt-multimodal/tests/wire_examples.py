"""One example of every Struct in yatt_multimodal.types, with non-default values, for the wire contract test
(tests/test_wire_contract.py at the workspace root) and its golden fixtures in golden/."""

from yatt_multimodal.types import (
    JudgeSpec,
    MediaLimits,
    Reward,
    RewardMetrics,
    RewardRequest,
    RewardSpec,
    StepCritique,
)
from yatt_rollout.types import MediaRef

EXAMPLES = [
    RewardRequest(
        request_id="c1-s0-p3-r2",
        prompt="What is 2+3?",
        response="2+3 = 5. The answer is \\boxed{5}.",
        reference="5",
        media=[MediaRef(kind="image", uri="data/img/3.png")],
        response_token_ids=[11, 12, 13],
        metadata={"source": "arith"},
    ),
    Reward(
        request_id="c1-s0-p3-r2",
        score=0.75,
        components={"math_verify": 1.0, "genrm": 0.5},
        token_scores=[0.0, 0.0, 1.0],
        critique="Step 2 is correct. Verdict: Yes",
    ),
    Reward(request_id="c1-s0-p3-r3", score=0.0, status="parse_error", error="no verdict phrase found"),
    JudgeSpec(num_samples=4, parser="score", score_range=(1.0, 5.0), on_parse_error="drop"),
    RewardSpec(kind="genrm", weight=0.5, judge=JudgeSpec(num_samples=2), options={"template": "v1"}),
]

EXAMPLES += [
    MediaLimits(formats=("PNG",), max_bytes=1024, max_pixels=4096, allow_remote=True),
    StepCritique(
        request_id="c1-s0-p3-r2",
        char_spans=[(0, 9), (11, 30)],
        token_spans=[(0, 3), (3, 9)],
        wrong_steps=[[1], [], [1]],
        num_unparsed=1,
        critiques=["Wrong steps: 2", "Wrong steps: none", "Wrong steps: 2", "I am not sure"],
    ),
    RewardMetrics(num_requests=8, num_judged=5, num_judgements=40, num_unparsed_judgements=3, num_timeout=1),
]
