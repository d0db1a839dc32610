"""The `yatt` command without a cluster: presets validate and plan, bad input exits 2 with a message naming
the field, file or row, before any Ray process starts."""

import json

import pytest
from yatt_apps.cli import STEP_FACTORIES, _load, main
from yatt_apps.config import PRESETS, RunConfig
from yatt_apps.launch import placement_plan


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_plan(name):
    cfg = PRESETS[name]()
    assert isinstance(cfg, RunConfig)
    plan = placement_plan(cfg, _load(STEP_FACTORIES[cfg.app]))
    actor = next(r for r in plan.roles if r.role == "actor")
    assert len(actor.replicas) == cfg.controller.num_controllers  # one controller per data-parallel rank


def test_production_preset_is_partial_colocated_on_64_devices(capsys):
    assert main(["plan", "--preset", "qwen2_5_math_1_5b_genrm_72b", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    roles = {r["role"]: r["replicas"] for r in plan["roles"]}
    assert plan["mode"] == "partial" and plan["num_devices"] == 64
    # rollout on [0, S), the TP-8 judge on [S, 64): disjoint, together every device, trainer on all 64
    rollout = sorted(d for rep in roles["rollout"] for d in rep)
    judge = sorted(d for rep in roles["genrm"] for d in rep)
    assert rollout == list(range(len(rollout))) and judge == list(range(len(rollout), 64))
    assert all(len(rep) == 8 for rep in roles["genrm"]) and len(roles["actor"]) == 64


def test_tiny_plan_is_colocated(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "mode colocated on 2 devices" in out and "genrm" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["grpo", "--set", "run.num_stepz=3"], r"unknown field `num_stepz` - at `\$\.run`"),
        (["grpo", "--set", "algo.clip_ratio_c=0.5"], r"clip_ratio_c must be > 1"),
        (
            ["grpo", "--set", "run.prompts_per_step=5"],
            r"must divide evenly over controller\.num_controllers \(2\)",
        ),
        (["grpo", "--preset", "huge"], r"--preset 'huge' is not one of"),
        (["grpo", "--set", "judge=null"], r"rewards has a 'genrm' term but judge"),
        (["resume", "/nonexistent/run"], r"/nonexistent/run is not a run directory"),
    ],
)
def test_bad_config_exits_2_naming_the_field(argv, message, capsys, tmp_path):
    assert main([*argv, *(["--run-dir", str(tmp_path / "run")] if argv[0] == "grpo" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"yatt {argv[0]}: error: ")
    assert pytest.importorskip("re").search(message, err), err


def test_bad_data_exits_2_before_any_cluster(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n')
    assert main(["grpo", "--set", f"data.train={data}", "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{data}:2: missing field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def test_overlong_prompt_exits_2_naming_the_row(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(
        '{"prompt": "1 + 1 =", "answer": "2"}\n' + '{"prompt": "%s", "answer": "3"}\n' % ("7 + " * 40)
    )
    run_dir = tmp_path / "run"
    assert main(["grpo", "--set", f"data.train={data}", "--set", "data.max_prompt_tokens=40",
                 "--run-dir", str(run_dir)]) == 2  # fmt: skip
    assert "train.jsonl:2: prompt has" in capsys.readouterr().err  # the 1-based line
