"""Validation of yatt_algos' configs: defaults follow the GRPO-with-GenRM recipe; bad values name the field."""

import msgspec
import pytest
from yatt_algos.types import AlgoConfig, OptimConfig


def test_defaults():
    cfg = AlgoConfig()
    assert (cfg.adv_estimator, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.loss_agg_mode) == (
        "grpo",
        0.2,
        0.2,
        "token-mean",
    )


def test_bad_values():
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1, got 0\.5"):
        AlgoConfig(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        OptimConfig(micro_batch_size=0)
    with pytest.raises(msgspec.ValidationError, match=r"Invalid enum value .sum. - at `\$\.loss_agg_mode`"):
        msgspec.json.decode(b'{"loss_agg_mode": "sum"}', type=AlgoConfig)
    with pytest.raises(msgspec.ValidationError, match="unknown field `lr_rate`"):
        msgspec.json.decode(b'{"lr_rate": 1e-6}', type=OptimConfig)


def test_new_fields_are_validated():
    with pytest.raises(ValueError, match=r"AlgoConfig.rollout_is_threshold must be > 1, got 0\.5"):
        AlgoConfig(rollout_is_threshold=0.5)
    with pytest.raises(ValueError, match=r"AlgoConfig.cispo_clip_ratio_high must be >= 0, got -1\.0"):
        AlgoConfig(cispo_clip_ratio_high=-1.0)
    with pytest.raises(
        msgspec.ValidationError, match=r"Invalid enum value 'tok' - at `\$\.rollout_is_level`"
    ):
        msgspec.json.decode(b'{"rollout_is_level": "tok"}', type=AlgoConfig)
