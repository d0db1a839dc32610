"""Multi-turn GRPO (`rollout.env`): the calculator environment, the response-mask hook, config checks, tools
in the prompt and the environment's own rows, and (slow) the agentic job end to end as a user runs it:
`yatt grpo --preset tiny_cpu_agent` with two parallel controllers on the HF engine, and with one on vLLM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
import torch
from yatt_apps.config import PRESETS, RolloutSpec, tiny_cpu
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime.agent import CalculatorEnv, check_env, mask_env_tokens
from yatt_apps.runtime.phases import pad_batch
from yatt_rollout.env import ENVIRONMENTS
from yatt_rollout.types import Action, ToolCall, Trajectory


def test_calculator_env_tools_feedback_and_reward():
    env = CalculatorEnv()
    env.reset({"prompt": "12 - 5 ="})  # no answer in the row: the prompt's own value (7) is the reference
    calc = env.step(
        Action(text="", tool_calls=[ToolCall(name="calculator", arguments={"expression": "12 - 5"})])
    )
    assert (calc.done, calc.tool_calls, [m.content for m in calc.observation.messages]) == (False, 1, ["7"])
    wrong = env.step(Action(text="the answer is 8"))
    assert (wrong.done, wrong.reward) == (False, 0.0)
    assert [(m.role, m.content) for m in wrong.observation.messages] == [("user", CalculatorEnv.FEEDBACK)]
    right = env.step(Action(text="so 12 - 5 = 7"))
    assert (right.done, right.reward) == (True, 1.0)
    env.reset({"prompt": "3 + 4 =", "answer": "-1"})  # a row's answer wins over the prompt's value
    assert env.step(Action(text="-1")).reward == 1.0


def test_mask_env_tokens_keeps_only_model_tokens():
    prompts = [[1, 2, 3], [4, 5]]
    trajs = [
        Trajectory(
            request_id="p0",
            index=0,
            token_ids=[10, 11, 3, 7, 12],
            logprobs=[-1.0, -2.0, 0.0, 0.0, -3.0],
            response_mask=[1, 1, 0, 0, 1],
            finish_reason="stop",
            policy_version=0,
        ),
        Trajectory(
            request_id="p1",
            index=0,
            token_ids=[20],
            logprobs=[-0.5],
            response_mask=[1],
            finish_reason="stop",
            policy_version=0,
        ),
    ]
    batch = pad_batch(prompts, [t.token_ids for t in trajs], pad_id=0)
    mask_env_tokens(batch, prompts, trajs)
    # the learner trains on the engine's ids (prompt + trajectory as generated), never a re-tokenisation
    for row, (prompt, traj) in enumerate(zip(prompts, trajs, strict=True)):
        n = len(prompt) + len(traj.token_ids)
        assert batch["input_ids"][row, :n].tolist() == prompt + traj.token_ids
    assert batch["response_mask"].int().tolist() == [[0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].int().tolist() == [[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]]


def test_check_env_names_the_key():
    cfg = msgspec.structs.replace(tiny_cpu(), rollout=RolloutSpec(env="nope", max_turns=3))
    with pytest.raises(
        ValueError, match=r"rollout.env 'nope' is not a registered environment; registered: \["
    ):
        check_env(cfg)
    with pytest.raises(
        ValueError, match=r"rollout.env is supported by the \['grpo'\] app\(s\), not app='ppo'"
    ):
        check_env(msgspec.structs.replace(cfg, app="ppo", rollout=RolloutSpec(env="calculator")))
    with pytest.raises(
        ValueError, match=r"rollout.env 'yatt_apps.runtime.agent:Missing': cannot load 'Missing'"
    ):
        check_env(msgspec.structs.replace(cfg, rollout=RolloutSpec(env="yatt_apps.runtime.agent:Missing")))
    check_env(msgspec.structs.replace(cfg, rollout=RolloutSpec(env="yatt_apps.runtime.agent:CalculatorEnv")))
    with pytest.raises(
        ValueError, match=r"rollout.tools_in_prompt and rollout.sft_steps need an environment"
    ):
        RolloutSpec(tools_in_prompt=True)
    assert ENVIRONMENTS["yatt_apps.runtime.agent:CalculatorEnv"] is CalculatorEnv


def test_prompts_render_the_environment_tools_and_prepare_writes_its_rows(tmp_path: Path):
    """`rollout.tools_in_prompt`: the step's prompt (render_prompt through `prompt_tokenizer`) is exactly the
    driver's rendering of the environment's reset with its tools; `prepare` writes the environment's own
    rows as the run's data (no warm start with rollout.sft_steps=0)."""
    from yatt_apps.runtime.agent import prompt_tokenizer
    from yatt_apps.runtime.agent_warmstart import prepare
    from yatt_apps.runtime.phases import render_prompt
    from yatt_rollout.agent import TurnCodec
    from yatt_rollout.tiny import train_tokenizer
    from yatt_rollout.tool_tasks import MultiplyEnv
    from yatt_rollout.types import Message

    tok = train_tokenizer(["347 * 86 = 29842 calculator expression"], vocab_size=300)
    agent = PRESETS["tiny_cpu_agent"]()
    cfg = msgspec.structs.replace(agent, rollout=msgspec.structs.replace(agent.rollout, sft_steps=0))
    row = PromptRow(prompt="347 * 86 =", answer="29842")
    ids = render_prompt(prompt_tokenizer(tok, cfg), row, "")
    assert ids == TurnCodec(tok).prompt_ids([Message(role="user", content=row.prompt)], MultiplyEnv().tools)
    assert '"name": "calculator"' in tok.decode(ids)
    off = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, tools_in_prompt=False))
    assert render_prompt(prompt_tokenizer(tok, off), row, "") == render_prompt(tok, row, "")
    prepared = prepare(cfg, tmp_path)
    assert prepared.model == cfg.model  # sft_steps=0: the tiny policy is built as usual
    train = [json.loads(line) for line in Path(prepared.data.train).read_text().splitlines()]
    assert train == MultiplyEnv.rows(cfg.data.num_train_rows, cfg.run.seed)
    assert len(Path(prepared.data.val).read_text().splitlines()) == cfg.data.num_val_rows


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_grpo_agent_job_two_steps(yatt_cli, monkeypatch, tmp_path: Path, engine: str):
    """`yatt grpo --preset tiny_cpu_agent` as a user runs it on a fresh machine (two parallel controllers on HF,
    one on vLLM; an empty model cache), in the test process: its multi-turn SFT warm start copied from the
    package (`runtime.shipped`: no SFT and no warm-starting message), the environment's rows, the tools in
    every prompt, episodes on the engine (each advancing on its own), validation with and without the tools
    (on HF; the vLLM run skips validation to save the suite's time)."""
    run_dir = tmp_path / "agent"
    sets = {
        "rollout.engine": engine,
        "run.num_steps": "2",
        "run.prompts_per_step": "8",
        "sampling.n": "4",
        "run.eval_every": "1" if engine == "hf" else "0",  # validation's two passes: once, on HF
        "data.num_val_rows": "8",
        "controller.count_driver_bytes": "true",
    }
    # on vLLM one engine (its start is most of a CPU run's cost): one device, one controller
    if engine == "vllm":
        sets |= {"placement.cluster.devices_per_node": "1", "controller.num_controllers": "1"}
    argv = ["grpo", "--preset", "tiny_cpu_agent", "--run-dir", str(run_dir)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path / "cache"))  # an empty model cache
    summary = yatt_cli(*argv)
    assert "warm-starting" not in yatt_cli.stderr  # the shipped warm start, copied
    # parallel controllers: only step reports reach the driver
    assert summary["driver_bytes"] < 300_000 and summary["restarts"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    if engine == "hf":  # greedy with the calculator right on some of the 8, without it on none
        assert rows[0]["val/accuracy"] > 0 and rows[0]["val/accuracy_no_tools"] == 0
    train = (run_dir / "task" / "train.jsonl").read_text().splitlines()
    assert json.loads(train[0])["prompt"].endswith(" =") and " * " in json.loads(train[0])["prompt"]
    for row in rows:
        for key in (
            "agent/turns_mean",
            "agent/tool_calls",
            "agent/tool_success",
            "agent/truncated",
            "agent/tool_errors/malformed",
            "reward/mean",
            "train/loss",
            *(("val/accuracy", "val/accuracy_no_tools") if engine == "hf" else ()),
        ):
            assert key in row and math.isfinite(row[key]), key
        assert 1.0 <= row["agent/turns_mean"] <= 3.0
        # the response mask counts model tokens only: at most 3 turns of max_new_tokens (32) each
        assert 0 < row["rollout/response_len_mean"] <= 96.0
        # the warm-started policy calls the calculator and answers some prompts right (a fresh one: none)
        assert row["agent/tool_calls"] > 0 and row["reward/mean"] > 0
        # the learner's logprobs of the model tokens equal the engine's: the trained ids are the engine's
        assert row["train/rollout_mismatch"] < (1e-4 if engine == "hf" else 1e-3)
        assert row["agent/tool_calls"] >= sum(v for k, v in row.items() if k.startswith("agent/tool_errors/"))
        assert 0.0 <= row["agent/tool_success"] <= 1.0
    assert torch.isfinite(torch.tensor([v for v in rows[-1].values() if isinstance(v, float)])).all()
