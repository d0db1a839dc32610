"""Validation of yatt_multimodal's specs: the GenRM defaults of the paper, and bad values naming the field."""

import msgspec
import pytest
from yatt_multimodal.types import JudgeSpec, Reward, RewardSpec


def test_judge_defaults_follow_the_paper():
    spec = JudgeSpec()
    assert (spec.num_samples, spec.temperature, spec.top_p, spec.max_new_tokens) == (8, 0.7, 0.9, 512)


def test_bad_values():
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        JudgeSpec(num_samples=0)
    with pytest.raises(ValueError, match="score_range must be increasing"):
        JudgeSpec(score_range=(5.0, 1.0))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.judge\.num_samples"):
        msgspec.json.decode(b'{"kind": "genrm", "judge": {"num_samples": "eight"}}', type=RewardSpec)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.status"):
        msgspec.json.decode(b'{"request_id": "r", "score": 0, "status": "silent_zero"}', type=Reward)
