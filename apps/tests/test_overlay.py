"""Config overlay: preset <- YAML <- --set, validated once, errors naming the field and its source."""

import msgspec
import pytest
from yatt_algos.types import AlgoConfig
from yatt_apps.overlay import build_config, parse_override, to_yaml


class Inner(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)


class Cfg(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: str = "tiny"
    steps: int = 10
    inner: Inner = Inner()
    algo: AlgoConfig = AlgoConfig()


def test_parse_override_types():
    assert parse_override("a.b=1.5e-6") == {"a": {"b": 1.5e-6}}
    assert parse_override("x=true") == {"x": True}
    assert parse_override("x=[1, 2]") == {"x": [1, 2]}
    assert parse_override("x=") == {"x": ""}
    with pytest.raises(ValueError, match=r"expected key\.path=value"):
        parse_override("novalue")
    with pytest.raises(ValueError, match=r"expected key\.path=value"):
        parse_override("a..b=1")


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 20\ninner:\n  lr: 3.0e-6\nalgo:\n  clip_ratio_high: 0.28\n")
    cfg = build_config(Cfg, Cfg(), path, ["inner.lr=5e-7", "algo.kl_loss_coef=0.01"])
    assert cfg.steps == 20 and cfg.inner.lr == 5e-7 and cfg.inner.betas == (0.9, 0.999)
    assert (cfg.algo.clip_ratio_high, cfg.algo.kl_loss_coef, cfg.algo.clip_ratio_low) == (0.28, 0.01, 0.2)
    assert build_config(Cfg, Cfg(), None, []) == Cfg()
    again = tmp_path / "resolved.yaml"
    again.write_text(to_yaml(cfg))
    assert build_config(Cfg, Cfg(), again) == cfg


def test_errors_name_field_and_source(tmp_path):
    with pytest.raises(ValueError, match=r"from --set stepz=3\): Object contains unknown field `stepz`"):
        build_config(Cfg, Cfg(), None, ["stepz=3"])
    with pytest.raises(
        ValueError, match=r"from --set inner.lr=fast.*Expected `float`, got `str` - at `\$\.inner\.lr`"
    ):
        build_config(Cfg, Cfg(), None, ["inner.lr=fast"])
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1.*\$\.algo"):
        build_config(Cfg, Cfg(), None, ["algo.clip_ratio_c=0.5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: the top level must be a mapping"):
        build_config(Cfg, Cfg(), bad)
    with pytest.raises(ValueError, match="config file not found"):
        build_config(Cfg, Cfg(), tmp_path / "missing.yaml")


def test_a_users_model_path_replaces_the_presets_warm_started_model(tmp_path):
    """`--set model.path=...` on a preset whose tiny models are warm-started: the user's model is used as is
    (warm_start none); the judge keeps its warm start until it gets a path too; an explicit warm_start stays
    (and a path with a warm start is still refused, naming the field)."""
    from yatt_apps.config import RunConfig, tiny_cpu

    cfg = build_config(RunConfig, tiny_cpu(), None, ["model.path=/models/Qwen2.5-Math-1.5B"])
    assert (cfg.model.path, cfg.model.warm_start, cfg.judge.warm_start) == (
        "/models/Qwen2.5-Math-1.5B",
        "none",
        "genrm",
    )
    path = tmp_path / "own.yaml"
    path.write_text("judge:\n  path: /models/judge\n")
    both = build_config(RunConfig, tiny_cpu(), path, ["model.path=/models/policy"])
    assert (both.model.warm_start, both.judge.warm_start) == ("none", "none")
    with pytest.raises(ValueError, match=r"warm-starts a tiny text model.*\$\.model"):
        build_config(RunConfig, tiny_cpu(), None, ["model.path=/m", "model.warm_start=policy"])


def test_the_jobs_score_response_tokens_only_unless_set():
    """Every job's config (RunConfig and the jobs' subclasses, presets included) scores response tokens only
    (`learner.score_prompt_tokens=false`, the learner's head skips the prompt); `--set` turns it back on, and
    the library's own default is unchanged."""
    from yatt_algos.types import LearnerConfig
    from yatt_apps.config import RunConfig, SftConfig, tiny_cpu

    assert LearnerConfig().score_prompt_tokens is True
    for cfg in (RunConfig(), SftConfig(), tiny_cpu()):
        assert cfg.learner.score_prompt_tokens is False, type(cfg).__name__
    on = build_config(RunConfig, tiny_cpu(), None, ["learner.score_prompt_tokens=true"])
    assert on.learner.score_prompt_tokens is True and on.learner.backend == tiny_cpu().learner.backend
