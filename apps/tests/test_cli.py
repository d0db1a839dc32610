"""The `yatt` command without a cluster: presets validate and plan, bad input exits 2 with a message naming
the field, file or row, before any Ray process starts; help lists the presets and main keys; `yatt config`
prints a config that loads back; resuming a finished run starts nothing."""

import json

import pytest
from yatt_apps.cli.main import main
from yatt_apps.config import RunConfig
from yatt_apps.jobs import find, presets
from yatt_apps.runtime.launch import placement_plan
from yatt_apps.runtime.progress import yatt_command

PRESETS = presets()  # config.PRESETS and every shipped job's default (some live in their job's module)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_plan(name):
    cfg = PRESETS[name]()
    assert isinstance(cfg, RunConfig)
    plan = placement_plan(cfg, find(cfg.app))
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
    """`yatt plan` prints the table alone (the JSON only with --json), its figure with units."""
    assert main(["plan"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mode colocated, 2 devices, version 0",
        "role     name  devices  replicas  group  device ids  shares with",
        "actor    -     2        2         1      0-1         rollout, genrm",
        "rollout  -     2        2         1      0-1         actor, genrm",
        "genrm    -     2        2         1      0-1         actor, rollout",
        "reason: every role time-shares all devices",
    ]
    assert main(["plan", "--set", "placement.mode=partial"]) == 0
    reason = capsys.readouterr().out.splitlines()[-1]
    assert reason.startswith("reason: split rollout 1, genrm 1: predicted concurrent load ")
    assert reason.endswith(" parameters per device (no profile: a proxy)")


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
    # no warm start: another training set is another tokenizer corpus, so another (80 s) warm start
    argv = [
        "grpo",
        "--set",
        f"data.train={data}",
        "--set",
        "data.max_prompt_tokens=40",
        "--run-dir",
        str(run_dir),
    ]
    argv += ["--set", "model.warm_start_steps=0", "--set", "judge.warm_start_steps=0"]
    assert main(argv) == 2
    assert f"{data}:2: prompt has" in capsys.readouterr().err  # the jsonl line of the overlong row


def test_help_lists_presets_and_main_keys(capsys):
    for argv in (["--help"], ["grpo", "--help"], ["dapo", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        for name in PRESETS:
            assert f"  {name} " in out, (argv, name)
        assert "the default: GRPO + rule rewards" in out
        for key in ("model.path", "data.train", "run.num_steps", "controller.checkpoint_every", "log.wandb"):
            assert key in out, (argv, key)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_prints_every_key_with_a_doc_and_loads_back(preset, capsys, tmp_path):
    from yatt_apps.cli.keydocs import undocumented
    from yatt_apps.overlay import build_config

    assert main(["config", "--preset", preset, "--set", "optim.lr=0.25"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# yatt config: preset {preset}\n")
    lines = out.splitlines()[1:]
    assert all("  # " in line and line.split("  # ", 1)[1].strip() for line in lines), [
        line for line in lines if "  # " not in line
    ]
    assert "  lr: 0.25  # peak learning rate (AdamW)" in lines
    assert undocumented(PRESETS[preset]()) == []
    (tmp_path / "c.yaml").write_text(out)
    cls = type(PRESETS[preset]())  # the preset's job's config class (RunConfig, or e.g. PpoConfig)
    want = build_config(cls, PRESETS[preset](), None, ["optim.lr=0.25"])
    assert build_config(cls, cls(), tmp_path / "c.yaml") == want


def _fake_run(tmp_path, num_steps: int, checkpoint_step: int | None):
    """A run directory as a job leaves it: config.yaml, and a checkpoint (yatt_controller's writer)."""
    from yatt_apps.overlay import to_yaml
    from yatt_controller import checkpoint

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    cfg = build_config_for_steps(num_steps)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    if checkpoint_step is not None:
        checkpoint.write_checkpoint(run_dir / "checkpoints", checkpoint_step, {"controller-0.msgpack": b"x"})
    return run_dir


def _log_steps(run_dir, last: int) -> None:
    """metrics.jsonl with steps 0..last, as the driver logs them."""
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {step}}}\n' for step in range(last + 1)))


def test_a_run_whose_last_steps_were_not_logged_is_not_finished(tmp_path):
    """kill -9 after the last step's checkpoint but before its report was logged: the checkpoint holds the
    report, so resume must run (it writes the report), not say the run is finished."""
    from yatt_apps.cli.main import finished_step

    run_dir = _fake_run(tmp_path, num_steps=5, checkpoint_step=4)
    _log_steps(run_dir, 4)
    assert finished_step(str(run_dir), 5) == 4
    _log_steps(run_dir, 2)
    assert finished_step(str(run_dir), 5) is None


def build_config_for_steps(num_steps: int) -> RunConfig:
    from yatt_apps.overlay import build_config

    return build_config(RunConfig, PRESETS["tiny_cpu"](), None, [f"run.num_steps={num_steps}"])


def test_resume_of_a_finished_run_starts_nothing(tmp_path, capsys, monkeypatch):
    import yatt_apps.runtime.launch

    def no_run(*args, **kwargs):
        raise AssertionError("a finished run must not start a job")

    monkeypatch.setattr(yatt_apps.runtime.launch, "run_job", no_run)
    run_dir = _fake_run(tmp_path, num_steps=5, checkpoint_step=4)
    _log_steps(run_dir, 4)
    assert main(["resume", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"run {run_dir} is finished: its last step (4) is done; to train longer: "
        f"{yatt_command()} resume {run_dir} --set run.num_steps=N"
    )
    assert json.loads(out[-1]) == {"run_dir": str(run_dir), "finished": True, "step": 4}


def test_finished_by_final_model_or_not_finished(tmp_path):
    from yatt_apps.cli.main import finished_step

    run_dir = _fake_run(tmp_path, num_steps=5, checkpoint_step=2)
    assert finished_step(str(run_dir), 5) is None  # checkpoint of step 2, 5 steps to do
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(5)))
    assert finished_step(str(run_dir), 5) is None  # no final model: the run died after logging step 4
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    assert finished_step(str(run_dir), 5) == 4
    assert finished_step(str(run_dir), 8) is None  # extended with --set run.num_steps=8
    assert finished_step(str(run_dir), 3) == 2  # the checkpoint alone says so


def test_interrupted_message_names_the_last_step_and_checkpoint(tmp_path):
    from yatt_apps.runtime.interrupt import interrupted_message

    run_dir = _fake_run(tmp_path, num_steps=5, checkpoint_step=1)
    assert interrupted_message(str(run_dir)).startswith("interrupted before the first step; resume with: ")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    assert interrupted_message(str(run_dir)) == (
        f"interrupted at step 2; resume with: {yatt_command()} resume {run_dir}\n"
        "(the run continues after the checkpoint of step 1)"
    )


def test_sigint_guard_first_raises_second_exits_130(tmp_path):
    """In a child process: the first SIGINT is a KeyboardInterrupt (caught, then the child waits in a
    cleanup), the second ends the process at once with 130."""
    import subprocess
    import sys

    code = (
        "import os, signal, sys, time\n"
        "from yatt_apps.runtime.interrupt import SigintGuard\n"
        "with SigintGuard():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT); time.sleep(30)\n"
        "    except KeyboardInterrupt:\n"
        "        print('first', flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGINT); time.sleep(30)\n"
        "print('not reached')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 130 and out.stdout == "first\n"
    assert "Ctrl-C again to exit at once" in out.stderr and "Traceback" not in out.stderr


def test_export_errors_name_the_step_and_folder(tmp_path, capsys):
    run_dir = _fake_run(tmp_path, num_steps=5, checkpoint_step=None)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "o")]) == 2
    assert f"{run_dir}: no complete checkpoint" in capsys.readouterr().err
    from yatt_controller import checkpoint

    checkpoint.write_checkpoint(run_dir / "checkpoints", 3, {"controller-0.msgpack": b"x"})
    assert main(["export", str(run_dir), "--step", "2", "--out", str(tmp_path / "o")]) == 2
    assert "--step 2: no checkpoint of that step; complete steps: [3]" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--out", str(tmp_path / "o")]) == 2
    assert "no learner-0.0.bin (the learner's state)" in capsys.readouterr().err
    (tmp_path / "o").mkdir()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "o")]) == 2
    assert f"--out {tmp_path / 'o'} already exists" in capsys.readouterr().err


def test_paper_preset_gets_past_placement_and_stops_on_missing_hardware(tmp_path, capsys):
    """The 64-device recipe plans (partial colocation) and then names the devices this machine lacks."""
    code = main(["grpo", "--preset", "qwen2_5_math_1_5b_genrm_72b", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1
    assert "the placement plan (partial) needs 64 devices (8 nodes x 8)" in err and "ray.address" in err


# ---- each job's own config -------------------------------------------------------------------------------

# the keys only some jobs have; every job has the shared RunConfig keys
OWN_KEYS = {
    "grpo": set(),
    "grpo-vlm": set(),
    "dapo": {"dynamic_sampling"},
    "ppo": {"critic_optim"},
    "capo": {"capo"},
    "sft": {"sft"},
    "dpo": {"dpo"},
    "distill": {"distill"},
}


@pytest.mark.parametrize("name", sorted(OWN_KEYS))
def test_yatt_config_of_each_job_lists_only_its_keys(name, capsys):
    assert main(["config", "--job", name]) == 0
    out = capsys.readouterr().out
    top = {line.split(":")[0] for line in out.splitlines() if line[:1].isalpha()}
    shared = set(RunConfig.__struct_fields__)
    assert top == shared | OWN_KEYS[name]
    others = set().union(*OWN_KEYS.values()) - OWN_KEYS[name]
    assert not top & others and f"app: {name}" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ppo", "--set", "capo.w_whole=1"], "'capo' is a key of the capo job's config, not of ppo's"),
        (
            ["grpo", "--set", "critic_optim.lr=1e-3"],
            "'critic_optim' is a key of the ppo job's config, not of grpo's",
        ),
        (["capo", "--set", "dynamic_sampling.max_refill=1"], "'dynamic_sampling' is a key of the dapo job's"),
        (["config", "--job", "dapo", "--set", "sft.train=x.jsonl"], "'sft' is a key of the sft job's config"),
    ],
)
def test_a_job_rejects_another_jobs_keys(argv, message, capsys, tmp_path):
    assert main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err


def test_a_job_config_from_a_yaml_file_is_checked_too(tmp_path, capsys):
    overlay = tmp_path / "o.yaml"
    overlay.write_text("capo:\n  w_whole: 1.0\n")
    assert main(["dapo", "--config", str(overlay), "--run-dir", str(tmp_path / "run")]) == 2
    assert "'capo' is a key of the capo job's config, not of dapo's" in capsys.readouterr().err
    # the job's own keys load, and a preset of another job keeps only the shared ones
    assert main(["config", "--job", "capo", "--config", str(overlay)]) == 0
    assert "w_whole: 1.0" in capsys.readouterr().out
    assert main(["config", "--job", "grpo", "--preset", "tiny_cpu_ppo"]) == 0
    out = capsys.readouterr().out
    assert "app: grpo" in out and "critic_optim" not in out


def test_yatt_run_names_a_file_without_a_job(tmp_path, capsys):
    empty = tmp_path / "not_a_job.py"
    empty.write_text("X = 1\n")
    assert main(["run", str(empty)]) == 2
    assert f"{empty}: defines no JOB = JobDef(...) (found NoneType for JOB)" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "missing.py: not a Python file" in capsys.readouterr().err


def test_the_registry_holds_every_shipped_job_under_its_config_app():
    from yatt_apps.jobs import registry

    jobs = registry()
    assert list(jobs) == ["grpo", "dapo", "ppo", "capo", "grpo-vlm", "sft", "dpo", "distill", "grpo-t2i"]
    for name, job in jobs.items():  # each job's preset is its own config class, naming the job
        cfg = job.preset()
        assert type(cfg) is job.config and cfg.app == name
