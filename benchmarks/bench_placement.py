"""Placement modes side by side in the step simulator (yatt-placement).

1. Each shipped scenario (paper: 64 devices, 1.5B policy, 72B judge, 8 judgements per response; paper-8: the
   paper's workload with a 7B judge on one 8-device node; single-judge;
   no-judge) under full colocated, partial colocated, disaggregated and dynamic placement: mean step time,
   rollout time (generation + judging) and idle fraction over the same seeded steps. Partial and disaggregated
   plans come from the planner fed with a simulated profile (`profiled_plan`); dynamic starts from the partial
   plan and re-plans every step. Reported: partial colocated's rollout-time reduction against full colocated
   (the paper reports 16.2-24.1% on its cluster).
2. Sensitivity of that reduction to the judge's work (median verdict length) on the paper's shape.
3. Drifting lengths (the `drift` scenario: responses lengthen about 20x over the run): every static rollout/judge
   split against the dynamic re-planner, total time over the run; reported: the gain of dynamic over the best
   static split, chosen in hindsight.
The figures of 1-3 come from the simulator's hardware and workload model (see yatt_placement.simulator), not
from a cluster.
4. Live: the real tiny GRPO job with its real tiny judge (`yatt_apps.runtime.launch.run_job`, one shared local
   Ray, 4 logical devices, one controller) under colocated placement, partial at the planner's split and at
   1 rollout / 3 judge devices, and dynamic started at a poor split (3 rollout devices, 1 judge) with the
   re-planner's default settings, then the two partial splits once more: measured seconds per step (median
   after the first; a split run twice pools the steps of both runs, which bracket the dynamic run in time, so
   a machine that drifts during the benchmark favours neither side), the dynamic run's moves and its steady
   step time after its moves (after the last, when 3 steps follow it) beside the best static split's, chosen
   in hindsight (`live.dynamic_vs_best_static`; the static splits are the two partial splits and the dynamic
   run's own steps before its first move). Beside them, the prediction of `yatt_placement.machine` (logical
   devices sharing the machine's cores, chunked engine calls streaming into the judge, the other load on the
   machine, sampled from /proc during each run), fitted to the live colocated run only; its error on partial
   and dynamic is `live.sim_vs_live_rel_error`. `--keep DIR` keeps the run folders (`yatt plan --calibrate
   DIR/colocated`).
`--quick` takes 104-123 s on an idle 2-core machine (session 14, fresh clone; six live runs, whose start-up
dominates), more when the machine is loaded. The last printed line is one JSON object.

    python benchmarks/bench_placement.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

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


LIVE_SPLITS = {"partial": 0, "split-1": 1, "dynamic": 3}  # rollout devices at the start (0: the planner's)
AGAIN = "-again"  # a static split's second run, after the dynamic one


def live_config(mode: str, num_steps: int, rollout_replicas: int = 0):
    """The tiny GRPO job with its judge on 4 logical devices, one controller (all learner ranks), `mode`, with
    the re-planner's default settings (dynamic)."""
    from yatt_apps.config import PRESETS, ControllerSpec, PlacementConfig
    from yatt_placement.types import ClusterSpec

    cfg = PRESETS["tiny_cpu"]()
    replace = msgspec.structs.replace
    judge = replace(cfg.rewards[-1].judge, num_samples=4, max_new_tokens=16)  # judging is a real share
    return replace(
        cfg,
        rewards=[*cfg.rewards[:-1], replace(cfg.rewards[-1], judge=judge)],
        run=replace(cfg.run, num_steps=num_steps, prompts_per_step=8, eval_every=0, progress=False),
        # the driver reads step reports (and the re-planner its busy counters) every heartbeat: 0.25 s lets
        # a move decided after a 0.6 s step land a step or two later
        controller=ControllerSpec(
            mode="single", num_controllers=1, heartbeat_interval_s=0.25, hang_timeout_s=300.0
        ),
        placement=PlacementConfig(
            mode=mode,
            cluster=ClusterSpec(num_nodes=1, devices_per_node=4, device_memory_gb=16.0),
            rollout_replicas=rollout_replicas,
        ),
    )


class LoadSampler:
    """The other work on the machine while a run's steps go, sampled every 0.5 s from /proc: how many process
    groups (sched_autogroup sessions; the kernel shares the cores between them first) outside this process
    tree had a runnable thread. The simulator's `background_load`. Our own Ray workers descend from this
    process. `mean` is over the samples taken after the run's first step was logged (`metrics`, the run's
    metrics.jsonl, has a line): the steps the figures come from, not the start-up before them (most of a
    short run's wall time, and its load is not theirs); over every sample when fewer than two were taken then."""

    def __init__(self, metrics: Path | None = None) -> None:
        import threading

        self.metrics = metrics
        self.samples: list[int] = []
        self.stepping: list[int] = []  # the samples taken once the first step was logged
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        samples = self.stepping if len(self.stepping) >= 2 else self.samples
        return statistics.mean(samples) if samples else 0.0

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            busy = self.busy_groups()
            self.samples.append(busy)
            if self.metrics is not None and self.metrics.exists() and self.metrics.stat().st_size:
                self.stepping.append(busy)

    @staticmethod
    def busy_groups() -> int:
        from pathlib import Path

        parents: dict[int, int] = {}
        runnable: dict[int, str] = {}  # pid -> its autogroup, for processes with a runnable thread
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(proc.name)] = int(fields[1])
                tasks = (proc / "task").iterdir()
                if any((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R" for t in tasks):
                    runnable[int(proc.name)] = (proc / "autogroup").read_text().split()[0]
            except (OSError, IndexError, ValueError):
                continue
        me, groups = os.getpid(), set()
        for pid, group in runnable.items():
            node = pid
            while node > 1 and node != me:
                node = parents.get(node, 1)
            if node != me and group != "/autogroup-0":
                groups.add(group)
        return len(groups)


def live_runs(num_steps: int, keep: str = "") -> dict:
    """Each mode's measured metrics, per step, from real runs in one Ray session, with the machine's other
    load during each run (`LoadSampler`)."""
    import tempfile
    from pathlib import Path

    from yatt_apps.jobs.grpo import JOB
    from yatt_apps.runtime import local_ray
    from yatt_apps.runtime.launch import ENV, run_job

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    session = local_ray.start(num_cpus=32, num_gpus=8)
    out = {}
    runs = [
        ("colocated", "colocated", 0),
        *[(n, "dynamic" if n == "dynamic" else "partial", r) for n, r in LIVE_SPLITS.items()],
        # the static splits once more after the dynamic run: each split's figure pools its two runs, which
        # bracket the dynamic one in time (a machine that drifts during the benchmark favours no side)
        *[(f"{n}{AGAIN}", "partial", r) for n, r in LIVE_SPLITS.items() if n != "dynamic"],
    ]
    try:
        with tempfile.TemporaryDirectory() as scratch:
            root = (
                keep or scratch
            )  # --keep DIR: the run folders stay (for `yatt plan --calibrate DIR/colocated`)
            for name, mode, rollout in runs:
                # dynamic runs longer: two moves, each landing a few steps after its decision, the trial of the
                # second (which may undo it), then steady steps
                cfg = live_config(mode, num_steps + (14 if mode == "dynamic" else 0), rollout)
                with LoadSampler(Path(root) / name / "metrics.jsonl") as load:
                    summary = run_job(cfg, Path(root) / name, JOB)
                lines = (Path(root) / name / "metrics.jsonl").read_text().splitlines()
                placement = Path(root) / name / "placement.jsonl"
                out[name] = {
                    "cfg": cfg,
                    "summary": summary,
                    "steps": [json.loads(line) for line in lines],
                    "load": load.mean,
                    "decisions": placement.read_text().splitlines() if placement.exists() else [],
                }
    finally:
        session.shutdown()
    return out


def steady(steps: list[dict], key: str = "time/step") -> float:
    """Median over the steps after the first (its calls pay one-time costs)."""
    return statistics.median(s[key] for s in steps[1:])


def pooled(runs: dict, name: str, key: str = "time/step") -> float:
    """`steady` over the steps of `name`'s run and of its repeat (when there is one), pooled."""
    both = [runs[n]["steps"] for n in (name, f"{name}{AGAIN}") if n in runs]
    return statistics.median(s[key] for steps in both for s in steps[1:])


def live_shape(cfg, steps: list[dict]):
    """The live job's batch shape for the machine model: counts from the config, lengths from the run."""
    from yatt_placement.machine import CallShape

    response = statistics.median(s["rollout/response_len_mean"] for s in steps)
    return CallShape(
        num_prompts=cfg.run.prompts_per_step,
        samples_per_prompt=cfg.sampling.n,
        judgements=cfg.rewards[-1].judge.num_samples,
        prompt_tokens=25.0,  # the arithmetic task's chat-templated prompts (tiny tokenizer)
        response_tokens=response,
        max_response_tokens=2 * response,
        judge_prompt_tokens=120.0,  # verify_yes_no v2 around question, reference and response
        verdict_tokens=3.0,  # a constrained verdict phrase and eos
    )


def live_plan(cfg):
    """The plan a live run starts at (placement.rollout_replicas, else the planner's split)."""
    from yatt_apps.jobs.grpo import JOB
    from yatt_apps.runtime.launch import placement_plan

    return placement_plan(cfg, JOB)


def fit_live(run: dict):
    """The machine model fitted to one run (the colocated one): its median phase times and its load."""
    from yatt_placement.machine import fit_machine

    steps, cfg = run["steps"], run["cfg"]
    measured = {
        "rollout_s": steady(steps, "time/rollout_s"),
        "reward_s": steady(steps, "time/reward_s"),
        "trainer_s": statistics.median(
            s["time/step"] - s["time/rollout_reward"] - s["time/weight_sync"] - s.get("time/sleep", 0.0)
            for s in steps[1:]
        ),
        "sync_s": steady(steps, "time/weight_sync"),
        "swap_s": statistics.median(s.get("time/sleep", 0.0) for s in steps[1:]),
    }
    return fit_machine(measured, live_shape(cfg, steps), live_plan(cfg), PHYSICAL_UNITS, run["load"])


def live_roles(cfg):
    from yatt_apps.jobs.grpo import JOB

    return JOB.roles(cfg)


def predict_live(model, run: dict) -> tuple[float, list[float]]:
    """The machine model's median step time of a live run (at its own load) and its per-step predictions.
    Dynamic: the re-planner with the run's settings observes the predicted busy time each step; a move lands
    two steps after its decision (as live, at 0.25 s heartbeats) and its landing step is not modelled."""
    from yatt_placement.machine import step_time
    from yatt_placement.types import PhaseStats

    cfg, steps = run["cfg"], run["steps"]
    model = msgspec.structs.replace(model, background_load=run["load"])
    shape, current = live_shape(cfg, steps), live_plan(cfg)
    replanner = None
    if cfg.placement.mode == "dynamic":
        replanner = DynamicReplanner(cfg.placement.cluster, live_roles(cfg), current, cfg.placement.replan)
    landing: list[tuple[int, object]] = []
    times = []
    for step in range(len(steps)):
        while landing and landing[0][0] <= step:
            current = landing.pop(0)[1]
        predicted = step_time(model, shape, current)
        times.append(predicted.step_s)
        if replanner is not None:
            devices = {"rollout": current.num_replicas("rollout"), "genrm": current.num_replicas("genrm")}
            busy = {"rollout": predicted.busy_device_s["rollout"], "genrm": predicted.busy_device_s["judge"]}
            per_device = {key: busy[key] / devices[key] for key in devices}
            stats = PhaseStats(
                step=step, step_time_s=predicted.step_s, busy_s=per_device, num_devices=devices
            )
            new = replanner.observe(stats)
            if new is not None:
                landing.append((step + 2, new))
    return statistics.median(times[1:]), times


STEADY_STEPS = 3  # steps after a move that make its steady time


def dynamic_after_moves(run: dict) -> tuple[int, float | None, int]:
    """(moves, the dynamic run's steady step time: the median step time after its last move landed, or after
    its first when fewer than `STEADY_STEPS` steps follow the last; the steps at which a move landed excluded
    (they build new replicas); None when no step is left, the step the first move landed at)."""
    steps = run["steps"]
    devices = [s.get("placement/rollout_devices") for s in steps]
    moves = int(steps[-1].get("placement/moves", 0))
    landed = [i for i in range(1, len(steps)) if devices[i] != devices[i - 1]]
    if not landed:
        return moves, steady(steps), 0
    since = landed[-1] if len(steps) - 1 - landed[-1] >= STEADY_STEPS else landed[0]
    after = [s["time/step"] for i, s in enumerate(steps) if i > since and i not in landed]
    return moves, statistics.median(after) if after else None, landed[0]


PHYSICAL_UNITS = len(os.sched_getaffinity(0))  # the cores this process (and Ray) may use


def live_section(num_steps: int, keep: str = "") -> dict:
    runs = live_runs(num_steps, keep)
    names = [name for name in runs if not name.endswith(AGAIN)]
    step_s = {name: pooled(runs, name) for name in names}
    model = fit_live(runs["colocated"])
    predicted = {  # a split run twice: the mean of the two runs' predictions (each at its own load)
        name: statistics.mean(predict_live(model, runs[n])[0] for n in (name, f"{name}{AGAIN}") if n in runs)
        for name in names
    }
    errors = {m: abs(predicted[m] - step_s[m]) / step_s[m] for m in ("partial", "dynamic")}
    moves, after_move, landed = dynamic_after_moves(runs["dynamic"])
    # static splits, in hindsight: the planner's (partial), one rollout device (split-1), and the dynamic
    # run's start (3 rollout devices) over its steps before the first move landed (the warm-up step excluded)
    dyn = runs["dynamic"]["steps"]
    first_move = next((i for i in range(1, len(dyn)) if dyn[i].get("placement/moves", 0) > 0), len(dyn))
    split = live_plan(runs["partial"]["cfg"]).num_replicas("rollout")
    static = {
        f"rollout {split} / judge {4 - split}": step_s["partial"],
        "rollout 1 / judge 3": step_s["split-1"],
    }
    if first_move > 1:
        static["rollout 3 / judge 1"] = statistics.median(s["time/step"] for s in dyn[1:first_move])
    best = min(static, key=static.get)
    ratio = after_move / static[best] if after_move else None
    print(
        f"\nlive: tiny GRPO + tiny judge on 4 logical devices ({PHYSICAL_UNITS} CPU cores), {num_steps} steps"
    )
    for name in names:
        again = runs.get(f"{name}{AGAIN}")
        each = (
            ""
            if again is None
            else f" (runs {steady(runs[name]['steps']):.3f}, {steady(again['steps']):.3f})"
        )
        loads = "/".join(f"{r['load']:.1f}" for r in (runs[name], again) if r is not None)
        print(
            f"  {name:<10} measured {step_s[name]:6.3f} s/step{each}   simulator {predicted[name]:6.3f} s/step"
            f"   other load {loads} runnable"
        )
    print(f"  static splits (rollout devices): {static}; best {best}")
    print(
        f"  dynamic: {moves} moves, the first landed at step {landed}; steady after them {after_move} s/step"
    )
    for line in runs["dynamic"]["decisions"]:
        print("   ", line[:200])
    return {
        "colocated_step_s": round(step_s["colocated"], 3),
        "partial_step_s": round(step_s["partial"], 3),
        "dynamic_step_s": round(step_s["dynamic"], 3),
        "static_step_s": {k: round(v, 3) for k, v in static.items()},
        "dynamic_steady_step_s": round(after_move, 3) if after_move else None,
        "dynamic_moves": moves,
        "dynamic_vs_best_static": round(ratio, 3) if ratio else None,
        "partial_overlap_s": round(pooled(runs, "partial", "time/rollout_reward_overlap_s"), 3),
        "sim_step_s": {m: round(v, 3) for m, v in predicted.items()},
        "sim_fitted": msgspec.to_builtins(model),
        "sim_vs_live_rel_error": round(statistics.mean(errors.values()), 3),
        "other_load": {name: round(r["load"], 2) for name, r in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller batches and fewer steps (under a minute)"
    )
    parser.add_argument("--keep", default="", help="keep the live runs' folders under this directory")
    args = parser.parse_args()
    began = time.perf_counter()
    if args.quick:
        prompts = {"paper": 256, "paper-8": 64, "single-judge": 64, "no-judge": 64}
        modes = modes_section(list(prompts), prompts, num_steps=2)
        sensitivity = sensitivity_section([60.0, 250.0], num_prompts=256)
        drift = drift_section(num_prompts=64, num_steps=32)
        live = live_section(num_steps=8, keep=args.keep)
    else:
        prompts = {"paper": 256, "paper-8": 64, "single-judge": 128, "no-judge": 128}
        modes = modes_section(list(prompts), prompts, num_steps=4)
        sensitivity = sensitivity_section([60.0, 120.0, 250.0, 500.0], num_prompts=256)
        drift = drift_section(num_prompts=64, num_steps=48)
        live = live_section(num_steps=12, keep=args.keep)
    summary = {
        "quick": args.quick,
        "scenarios": modes,
        "paper_partial_over_full_rollout_reduction": modes["paper"]["partial_over_full_rollout_reduction"],
        "paper_reported_reduction": [0.162, 0.241],
        "paper_reduction_by_judge_tokens": sensitivity,
        "drift": drift,
        "dynamic_over_best_static_gain": drift["dynamic_over_best_static_gain"],
        "live": live,
        **{f"live.{key}": value for key, value in live.items() if not isinstance(value, dict)},
        "wall_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
