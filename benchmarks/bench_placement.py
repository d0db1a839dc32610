"""Placement modes side by side in the step simulator (yatt-placement).

1. Each shipped scenario (paper: 64 devices, 1.5B policy, 72B judge, 8 judgements per response; single-judge;
   no-judge) under full colocated, partial colocated, disaggregated and dynamic placement: mean step time,
   rollout time (generation + judging) and idle fraction over the same seeded steps. Partial and disaggregated
   plans come from the planner fed with a simulated profile (`profiled_plan`); dynamic starts from the partial
   plan and re-plans every step. Reported: partial colocated's rollout-time reduction against full colocated
   (the paper reports 16.2-24.1% on its cluster).
2. Sensitivity of that reduction to the judge's work (median verdict length) on the paper's shape.
3. Drifting lengths (the `drift` scenario: responses lengthen about 20x over the run): every static rollout/judge
   split against the dynamic re-planner, total time over the run; reported: the gain of dynamic over the best
   static split, chosen in hindsight.
The figures come from the simulator's hardware and workload model (see yatt_placement.simulator), not from a
cluster. `--quick` runs in under a minute on 2 cores. The last printed line is one JSON object.

    python benchmarks/bench_placement.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec
from yatt_placement.planner import lay_out, plan
from yatt_placement.replanner import DynamicReplanner
from yatt_placement.scenarios import get_scenario
from yatt_placement.simulator import Scenario, Simulator, profiled_plan

MODES = ("colocated", "partial", "disaggregated", "dynamic")


def run_mode(scenario: Scenario, mode: str, num_steps: int, seed: int) -> dict | None:
    """Mean step time, rollout time and idle fraction of `num_steps` steps; None if the mode does not apply."""
    try:
        if mode == "colocated":
            placement = plan(scenario.cluster, scenario.roles, "colocated")
        else:
            placement = profiled_plan(scenario, "partial" if mode == "dynamic" else mode, seed=seed)
    except ValueError:
        return None  # e.g. partial placement without a GenRM
    replanner = DynamicReplanner(scenario.cluster, scenario.roles, placement) if mode == "dynamic" else None
    simulator, results = Simulator(scenario, seed=seed), []
    for step in range(num_steps):
        result = simulator.step(replanner.plan if replanner else placement, step)
        results.append(result)
        if replanner:
            replanner.observe(result.phase_stats())
    return {
        "step_s": round(statistics.mean(r.step_time_s for r in results), 2),
        "rollout_s": round(statistics.mean(r.rollout_time_s for r in results), 2),
        "idle_fraction": round(statistics.mean(r.idle_fraction for r in results), 3),
        "devices": {key: count for key, count in results[-1].num_devices.items()},
    }


def modes_section(names: list[str], num_prompts: dict[str, int], num_steps: int) -> dict:
    out = {}
    for name in names:
        scenario = get_scenario(name, num_prompts=num_prompts[name])
        rows = {mode: run_mode(scenario, mode, num_steps, seed=0) for mode in MODES}
        full, partial = rows["colocated"], rows["partial"]
        reduction = round(1 - partial["rollout_s"] / full["rollout_s"], 3) if partial else None
        out[name] = {"modes": rows, "partial_over_full_rollout_reduction": reduction}
        print(f"\n{name}: {scenario.cluster.num_devices} devices, {num_prompts[name]} prompts per step")
        print(f"  {'mode':<14}{'step s':>9}{'rollout s':>11}{'idle':>7}  devices")
        for mode, row in rows.items():
            if row is None:
                print(f"  {mode:<14}{'n/a (needs a GenRM)':>27}")
                continue
            print(
                f"  {mode:<14}{row['step_s']:>9.1f}{row['rollout_s']:>11.1f}{row['idle_fraction']:>7.2f}  {row['devices']}"
            )
        if reduction is not None:
            print(f"  partial colocated rollout time vs full colocated: {-100 * reduction:+.1f}%")
    return out


def sensitivity_section(judge_tokens: list[float], num_prompts: int) -> dict:
    print("\npaper shape, partial vs full rollout time by median judge verdict length:")
    out = {}
    for tokens in judge_tokens:
        base = get_scenario("paper", num_prompts=num_prompts)
        scenario = msgspec.structs.replace(
            base, workload=msgspec.structs.replace(base.workload, judge_median_tokens=tokens)
        )
        full = run_mode(scenario, "colocated", 1, seed=0)
        partial = run_mode(scenario, "partial", 1, seed=0)
        out[str(int(tokens))] = round(1 - partial["rollout_s"] / full["rollout_s"], 3)
        print(
            f"  judge median {tokens:>5.0f} tokens: {-100 * out[str(int(tokens))]:+.1f}% ({num_prompts} prompts)"
        )
    return out


def drift_section(num_prompts: int, num_steps: int) -> dict:
    scenario = get_scenario("drift", num_prompts=num_prompts, num_steps=num_steps)
    n = scenario.cluster.num_devices
    judge = next(spec for spec in scenario.roles if spec.role == "genrm")
    static = {}
    for s in range(judge.model_parallel_size, n, judge.model_parallel_size):
        split = lay_out(scenario.cluster, scenario.roles, "partial", {"rollout": s, "judge": n - s})
        simulator = Simulator(scenario, seed=0)
        static[s] = sum(simulator.step(split, step).step_time_s for step in range(num_steps))
    replanner = DynamicReplanner(scenario.cluster, scenario.roles, profiled_plan(scenario, "dynamic"))
    start = replanner.devices("rollout")
    simulator, dynamic, moves = Simulator(scenario, seed=0), 0.0, []
    for step in range(num_steps):
        result = simulator.step(replanner.plan, step)
        dynamic += result.step_time_s
        if replanner.observe(result.phase_stats()):
            moves.append([step, replanner.devices("rollout")])
    best = min(static, key=static.get)
    gain = 1 - dynamic / static[best]
    wl = scenario.workload
    last = wl.gen_median_tokens * (1 + wl.gen_growth_per_step * (num_steps - 1))
    print(
        f"\ndrift: {n} devices, {num_prompts} prompts, {num_steps} steps, median response {wl.gen_median_tokens:.0f}",
        end="",
    )
    print(f" -> {last:.0f} tokens")
    for s, total in static.items():
        print(
            f"  static rollout {s} / judge {n - s}: {total:9.1f} s"
            + ("  <- best static" if s == best else "")
        )
    print(f"  dynamic (start rollout {start}, moves [step, rollout devices] {moves}): {dynamic:9.1f} s")
    print(f"  dynamic vs best static: {100 * gain:+.1f}% less total time")
    return {
        "static_total_s": {str(s): round(t, 1) for s, t in static.items()},
        "best_static_rollout_devices": best,
        "dynamic_total_s": round(dynamic, 1),
        "dynamic_start_rollout_devices": start,
        "dynamic_moves": moves,
        "dynamic_over_best_static_gain": round(gain, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller batches and fewer steps (under a minute)"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    if args.quick:
        prompts = {"paper": 256, "single-judge": 64, "no-judge": 64}
        modes = modes_section(list(prompts), prompts, num_steps=2)
        sensitivity = sensitivity_section([60.0, 250.0], num_prompts=256)
        drift = drift_section(num_prompts=64, num_steps=32)
    else:
        prompts = {"paper": 256, "single-judge": 128, "no-judge": 128}
        modes = modes_section(list(prompts), prompts, num_steps=4)
        sensitivity = sensitivity_section([60.0, 120.0, 250.0, 500.0], num_prompts=256)
        drift = drift_section(num_prompts=64, num_steps=48)
    summary = {
        "quick": args.quick,
        "scenarios": modes,
        "paper_partial_over_full_rollout_reduction": modes["paper"]["partial_over_full_rollout_reduction"],
        "paper_reported_reduction": [0.162, 0.241],
        "paper_reduction_by_judge_tokens": sensitivity,
        "drift": drift,
        "dynamic_over_best_static_gain": drift["dynamic_over_best_static_gain"],
        "wall_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
