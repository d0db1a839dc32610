"""Agentic GRPO learns to use its tool: the embedded `tiny_cpu_agent` run through the real job
(`yatt_apps.runtime.launch.run_job`, one local Ray session), and episodes batched across turns.

- `agent.acc_start`: greedy validation accuracy with the calculator (`val/accuracy`) at step 0, the policy
  right after its multi-turn SFT warm start; `agent.acc_end` the same at the last step, after RL;
  `agent.acc_no_tools_end` the last step's policy with the tools withheld (`val/accuracy_no_tools`);
  `agent.tool_success_end` the share of the last step's tool calls that ran without error. Targets (issue
  31): acc_end - acc_start >= 0.15, acc_end - acc_no_tools_end >= 0.3.
- `agent.batched_speedup`: the warm-started policy's greedy episodes on the HF engine, all episodes of a
  batch decoded together (`AgentDriver.run` on every request: each episode advancing on its own, its turns
  joining the HF engine's running batch) vs one episode at a time; greedy, so both give the same
  trajectories (checked). Target >= 2.
- `agent.continuous_vs_turn_sync`: the same episodes with a tool that sleeps a random 0-50 ms per step with
  tool calls (seeded by the prompt), wall time of the turn-synchronous driver (`continuous=False`: one
  `generate` per turn over every live episode, every tool step before the next turn) over the default one
  (each episode's next turn submitted as soon as its tool returns); same trajectories (checked).

    python benchmarks/bench_agent.py --quick

The warm start is shipped with yatt-apps (`runtime.shipped`) and copied into the cache (~/.cache/yatt/models,
`agent-KEY`) on first use; only a recipe that misses the shipped one trains it (800 SFT steps: about 8
minutes on two loaded cores; `agent.seconds` then includes it). The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path


def learning(quick: bool) -> tuple[dict, str]:
    """The embedded run's accuracies and tool success; also the warm-started policy's folder."""
    import msgspec
    from yatt_apps.config import tiny_cpu_agent
    from yatt_apps.jobs.grpo import JOB
    from yatt_apps.runtime.agent_warmstart import warm_started
    from yatt_apps.runtime.launch import run_job
    from yatt_rollout.tool_tasks import MultiplyEnv

    cfg = tiny_cpu_agent()
    run = msgspec.structs.replace(cfg.run, progress=False)
    cfg = msgspec.structs.replace(cfg, run=run)
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        started = time.perf_counter()
        run_job(cfg, Path(tmp) / "run", JOB)
        seconds = time.perf_counter() - started
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    policy = str(warm_started(cfg, MultiplyEnv))  # the cached warm start the run began from
    evaluated = [row for row in rows if "val/accuracy" in row]
    first, last = evaluated[0], evaluated[-1]
    return {
        "agent.acc_start": first["val/accuracy"],
        "agent.acc_end": last["val/accuracy"],
        "agent.acc_no_tools_start": first["val/accuracy_no_tools"],
        "agent.acc_no_tools_end": last["val/accuracy_no_tools"],
        "agent.tool_success_end": rows[-1]["agent/tool_success"],
        "agent.reward_first": rows[0]["reward/mean"],
        "agent.reward_last": rows[-1]["reward/mean"],
        "agent.steps": len(rows),
        "agent.seconds": seconds,
    }, policy


def batched_speedup(policy: str, num_episodes: int) -> dict:
    """Wall time of `num_episodes` greedy episodes one at a time over all together, same trajectories."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from yatt_rollout.agent import AgentDriver
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.tool_tasks import MultiplyEnv
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).float().eval()
    engine = HFEngine(model, tok, max_batch_size=num_episodes, seed=0)
    driver = AgentDriver(engine, tok, MultiplyEnv, max_turns=3, max_total_tokens=512)
    rows = MultiplyEnv.rows(num_episodes, seed=99)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=32)
    reqs = [
        GenerateRequest(request_id=f"p{i}", prompt=Prompt(token_ids=[]), sampling=greedy)
        for i in range(num_episodes)
    ]
    try:
        driver.run(reqs[:2], rows[:2])  # warm-up
        started = time.perf_counter()
        together = driver.run(reqs, rows)
        batched = time.perf_counter() - started
        started = time.perf_counter()
        alone = [driver.run([r], [row])[0] for r, row in zip(reqs, rows, strict=True)]
        serial = time.perf_counter() - started
    finally:
        engine.close()
    same = all(a.token_ids == b.token_ids for a, b in zip(together, alone, strict=True))
    return {
        "agent.batched_speedup": serial / batched,
        "agent.batched_seconds": batched,
        "agent.serial_seconds": serial,
        "agent.batched_same_trajectories": same,
        "agent.batched_episodes": num_episodes,
    }


class SleepyTool:
    """`MultiplyEnv` whose steps with tool calls first sleep a random 0-50 ms (a slow tool), seeded by the
    episode's prompt so both drivers see the same delays."""

    def __init__(self) -> None:
        from yatt_rollout.tool_tasks import MultiplyEnv

        self.env = MultiplyEnv()
        self.tools = self.env.tools
        self.rng = random.Random(0)

    def reset(self, row: dict):
        self.rng = random.Random(row["prompt"])
        return self.env.reset(row)

    def step(self, action):
        if action.tool_calls:
            time.sleep(self.rng.uniform(0.0, 0.05))
        return self.env.step(action)


def continuous_vs_turn_sync(policy: str, num_episodes: int) -> dict:
    """Wall time of the turn-synchronous driver over the continuous one on the same greedy episodes with a
    slow tool (`SleepyTool`), same trajectories."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from yatt_rollout.agent import AgentDriver
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.tool_tasks import MultiplyEnv
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).float().eval()
    engine = HFEngine(model, tok, max_batch_size=num_episodes, seed=0)
    limits = {"max_turns": 3, "max_total_tokens": 512}
    drivers = {
        mode: AgentDriver(engine, tok, SleepyTool, continuous=mode == "continuous", **limits)
        for mode in ("continuous", "turn_sync")
    }
    rows = MultiplyEnv.rows(num_episodes, seed=98)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=32)
    reqs = [
        GenerateRequest(request_id=f"s{i}", prompt=Prompt(token_ids=[]), sampling=greedy)
        for i in range(num_episodes)
    ]
    seconds, out = {}, {}
    try:
        drivers["continuous"].run(reqs[:2], rows[:2])  # warm-up
        for mode, driver in drivers.items():
            started = time.perf_counter()
            out[mode] = driver.run(reqs, rows)
            seconds[mode] = time.perf_counter() - started
    finally:
        engine.close()
    pairs = zip(out["continuous"], out["turn_sync"], strict=True)
    return {
        "agent.continuous_vs_turn_sync": seconds["turn_sync"] / seconds["continuous"],
        "agent.continuous_seconds": seconds["continuous"],
        "agent.turn_sync_seconds": seconds["turn_sync"],
        "agent.continuous_same_trajectories": all(a.token_ids == b.token_ids for a, b in pairs),
        "agent.tool_calls_slow_tool": sum(t.tool_calls for t in out["continuous"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the preset's run and 32 episodes for the speedup"
    )
    args = parser.parse_args()
    load = os.getloadavg()[0]
    figures, policy = learning(args.quick)
    figures |= batched_speedup(policy, 32 if args.quick else 64)
    figures |= continuous_vs_turn_sync(policy, 32 if args.quick else 64)
    figures["load_start"], figures["load_end"] = load, os.getloadavg()[0]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
