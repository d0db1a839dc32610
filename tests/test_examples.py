"""Every script in examples/ runs and gives the numbers its README section promises (issue 20: embedding).

Each example is imported and its `main()` called in this process (one interpreter start-up for all), except
the vLLM one (its own process: vLLM keeps a torch.distributed group for the process's life); the
two-process example's workers are spawned by the example itself and import it by name from examples/.
Ray and vLLM examples, and the ones that spawn or train, are marked slow.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # spawned workers inherit sys.path and import the example by name
    return importlib.import_module(name)


def test_every_example_is_tested():
    tested = {
        "losses_in_your_loop",
        "engine_as_generator",
        "controller_hosts_your_classes",
        "trl_judge",
        "own_job",
        "agent_env",
    }
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_engine_as_generator_hf():
    pytest.importorskip("transformers")
    result = _example("engine_as_generator").main(["--engine", "hf", "--steps", "3"])
    # every step's completions carry the version pushed before it, and the engine's logprobs are the
    # raw distribution of the loop's own (updated) model
    assert [s["version"] for s in result["steps"]] == [0, 1, 2] and result["final_version"] == 3
    assert all(s["logprob_max_diff"] < 1e-4 for s in result["steps"])
    assert all(0 < s["tokens"] <= 4 * 4 * 12 for s in result["steps"])


@pytest.mark.slow
def test_engine_as_generator_vllm():
    """Run as its own process: an in-process vLLM engine sets up torch.distributed's default group (world 1)
    for the life of the process, which later in-process users of torch.distributed (the Megatron tests) own."""
    pytest.importorskip("vllm")
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache"),
    }
    script = EXAMPLES / "engine_as_generator.py"
    out = subprocess.run(
        [sys.executable, str(script), "--engine", "vllm", "--steps", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [s["version"] for s in result["steps"]] == [0, 1] and result["final_version"] == 2
    assert all(s["logprob_max_diff"] < 1e-4 for s in result["steps"])


@pytest.mark.slow
def test_losses_in_your_loop():
    result = _example("losses_in_your_loop").main([])
    assert result["tokens_per_rank"] == [22, 14]  # the fixed batch: uneven ranks
    # the invariance: two gloo processes with global counts give the one-process update
    assert result["max_param_diff"] < 1e-6 and result["ranks_param_diff"] == 0.0
    for two, one in zip(result["two_process_losses"], result["single_losses"], strict=True):
        assert abs(two - one) < 1e-6
    # and it is not vacuous: the update moved the weights, and per-rank counts (a plain DDP mean) differ
    assert result["param_change"] > 1e-2
    assert result["max_param_diff_local_counts"] > 1e-3


@pytest.mark.slow
def test_controller_hosts_your_classes():
    """Run on the test process's shared Ray session when one is up (the example uses a session its program
    already has, as an embedding would, and starts its own otherwise)."""
    import ray.cloudpickle

    module = _example("controller_hosts_your_classes")
    ray.cloudpickle.register_pickle_by_value(module)  # Ray workers cannot import examples/
    result = module.main([])
    assert result["placement"] == {"actor": [[0], [1]], "rollout": [[0], [1]]}
    assert result["straight_steps"] == [0, 1, 2, 3]
    assert result["first_steps"] == [0, 1] and result["resumed_steps"] == [2, 3]
    straight, resumed = result["straight"], result["resumed"]
    for step in ("2", "3"):
        # the resumed run draws the same prompts per controller, samples the same answers, and reaches the
        # same weights and counters as the run that never stopped
        assert resumed[step] == straight[step]
    for step, per_controller in straight.items():
        prompts = [m[f"prompt_{i}"] for m in per_controller for i in range(4)]
        assert len(set(prompts)) == 8  # the two controllers' shards are disjoint
        assert [m["samples_seen"] for m in per_controller] == [16 * (int(step) + 1)] * 2
        assert per_controller[0]["weights_l1"] == per_controller[1]["weights_l1"] > 0  # ranks agree
    assert result["resume_matches"] is True


@pytest.mark.slow
def test_trl_judge():
    pytest.importorskip("trl")
    result = _example("trl_judge").main([])
    assert result["num_steps"] == 2 and result["num_reward_calls"] == 2
    assert result["judge_loss"] < 0.5  # the tiny judge learned the verdict phrase
    for step in result["steps"]:
        column, scores = step["trl_reward_column"], step["adapter_scores"]
        assert len(column) == len(scores) == 8
        # TRL's reward column is exactly what the adapter returned (None would be NaN there)
        for t, a in zip(column, scores, strict=True):
            assert (a is None and math.isnan(t)) or t == a
        assert step["equal"] is True
        assert sum(step["statuses"].values()) == 8
        assert step["judge_judgements"] > 0  # the judge ran (K = 2 per unique completion)
        kept = [a for a in scores if a is not None]
        assert step["trl_logged_mean"] == pytest.approx(sum(kept) / len(kept), abs=1e-6)
    # the judge's verdicts parse (mostly) and move the scores: the comparison is not one of zeros
    assert sum(s["statuses"].get("ok", 0) for s in result["steps"]) >= 8
    assert any(a not in (None, 0.0) for s in result["steps"] for a in s["adapter_scores"])


# ---- a job of your own, through the `yatt` command (examples/own_job.py) --------------------------------------


def _yatt(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "yatt_apps.cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_own_job_config_and_plan_come_from_its_file(tmp_path):
    """`yatt config --job FILE` and `yatt plan --job FILE` read the file's JOB: its preset, no judge."""
    out = _yatt("config", "--job", str(EXAMPLES / "own_job.py"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "app: grpo-brevity" in out.stdout and "judge: null" in out.stdout
    out = _yatt("plan", "--job", str(EXAMPLES / "own_job.py"), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(r["role"] for r in plan["roles"]) == ["actor", "reward", "rollout"]  # no judge role


@pytest.mark.slow
def test_own_job_runs_through_yatt_run(tmp_path):
    """`yatt run examples/own_job.py`: 2 steps of 8 prompts x 4 samples on one device (one controller); every
    sample's score is the configured rules plus the file's own term (reward/mean = exact + 0.2 format + 0.5
    brevity)."""
    run_dir = tmp_path / "run"
    sets = ["run.num_steps=2", "run.prompts_per_step=8", "sampling.n=4", "run.eval_every=0"]
    sets += ["placement.cluster.devices_per_node=1", "controller.num_controllers=1"]
    argv = ["run", str(EXAMPLES / "own_job.py"), "--run-dir", str(run_dir), "--json"]
    out = _yatt(*argv, *(a for s in sets for a in ("--set", s)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["step"] == 1 and summary["restarts"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["reward_status/ok"] == 32.0  # 8 prompts x 4 samples, all scored
        assert 0.0 < row["reward/brevity_mean"] <= 1.0
        expected = (
            row["reward/math_verify_mean"]
            + 0.2 * row["reward/format_mean"]
            + 0.5 * row["reward/brevity_mean"]
        )
        assert row["reward/mean"] == pytest.approx(expected, abs=1e-9)
    assert "app: grpo-brevity" in (run_dir / "config.yaml").read_text()


def test_agent_env_in_one_file():
    """The one-file environment and tool: the prompt lists the tool, the call runs it, the answer scores."""
    pytest.importorskip("transformers")
    result = _example("agent_env").main([])
    assert result["tools_in_prompt"] is True
    assert "<tool_response>\n3\n</tool_response>" in result["episode"]
    assert (result["reward"], result["turns"], result["tool_calls"], result["tool_errors"]) == (1.0, 2, 1, {})
    rows = _example("agent_env").LetterCountEnv.rows(20, 1)
    assert all(
        row["answer"] == str(row["prompt"].split(" in ")[1][:-1].count(row["prompt"][9])) for row in rows
    )
