"""Every placement mode x controller mode runs the real tiny GRPO job with its judge (and DAPO in single mode
and PPO with parallel controllers, both disaggregated; colocated parallel they run in test_dapo_ppo.py): 2
steps to completion with finite metrics. Layouts that other job tests run are not run again here (see
MATRIX).

One Ray session (logical devices) is shared by every case of the module, and each job runs in this process
(`run_job` leaves a Ray it did not start running), so a case costs its own hosts' start-up only.
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from yatt_apps.config import PRESETS, ControllerSpec, PlacementConfig, RunConfig
from yatt_apps.jobs import find
from yatt_apps.runtime.launch import placement_plan, run_job
from yatt_placement.types import ClusterSpec, ReplanConfig

pytestmark = pytest.mark.slow


def small(
    preset: str, mode: str, controller: str, *, devices: int, controllers: int = 0, **placement
) -> RunConfig:
    """`preset` for 2 steps of 4 prompts on `devices` logical devices under (mode, controller); parallel
    controllers: `controllers` of them (default: 2 disaggregated, one per device otherwise)."""
    cfg = PRESETS[preset]()
    replace = msgspec.structs.replace
    parallel = controller == "parallel"
    num_controllers = (controllers or (2 if mode == "disaggregated" else devices)) if parallel else 1
    return replace(
        cfg,
        run=replace(cfg.run, num_steps=2, prompts_per_step=4, eval_every=0, progress=False),
        sampling=replace(cfg.sampling, n=4),
        controller=ControllerSpec(
            mode=controller,
            num_controllers=num_controllers,
            heartbeat_interval_s=1.0,
            hang_timeout_s=240.0,
            count_driver_bytes=True,  # the parallel cases assert the driver's bytes
        ),
        placement=PlacementConfig(
            mode=mode,
            cluster=ClusterSpec(num_nodes=1, devices_per_node=devices, device_memory_gb=16.0),
            **placement,
        ),
    )


def run(cfg: RunConfig, tmp_path, name: str) -> dict:
    return run_job(cfg, tmp_path / name, find(cfg.app))


def check(summary: dict, cfg: RunConfig) -> None:
    assert summary["step"] == cfg.run.num_steps - 1 and summary["restarts"] == 0
    numbers = {k: v for k, v in summary.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in numbers.values()), numbers
    assert summary["rollout/response_tokens"] > 0


# partial runs in test_dynamic_moves_devices_toward_a_slow_judge (dynamic starts as partial), colocated with
# parallel controllers in test_grpo_e2e (the default job), and the judged disaggregated layout with parallel
# controllers (learner 2, rollout 1, judge 1) in test_async.py (k=2) and, synchronous, in test_grpo_t2i.py and
# the PPO case below, so they have no case of their own here
MATRIX = [
    ("colocated", "single", 2),
    ("disaggregated", "single", 3),
]


# this case's policy is the tiny mixture of experts (Qwen3-MoE, 4 experts, top-2) with rollout routing replay:
# the MoE path runs in a job without a start of its own
MOE_CASE = ("colocated", "single")


def with_moe(cfg: RunConfig) -> RunConfig:
    replace = msgspec.structs.replace
    return replace(
        cfg,
        model=replace(cfg.model, arch="qwen3_moe", warm_start="none"),
        algo=replace(cfg.algo, routing_replay="r3"),
    )


@pytest.mark.parametrize(("mode", "controller", "devices"), MATRIX)
def test_grpo_with_judge_runs_in_every_layout(ray_session, tmp_path, mode, controller, devices):
    cfg = small("tiny_cpu", mode, controller, devices=devices)
    if (mode, controller) == MOE_CASE:
        cfg = with_moe(cfg)
    summary = run(cfg, tmp_path, f"{mode}-{controller}")
    check(summary, cfg)
    if (mode, controller) == MOE_CASE:  # R3: the learner routes as the rollout did, so its log-probs agree
        assert 0.0 < summary["train/moe/routing_agreement"] <= 1.0
        assert summary["train/rollout_mismatch"] < 1e-5, summary["train/rollout_mismatch"]
    assert summary["judge/parse_rate"] >= 0.0 and "time/rollout_reward_overlap_s" in summary
    if controller == "parallel":  # only step reports reach the driver: report-sized bytes
        assert summary["driver_bytes"] < 100_000, summary["driver_bytes"]
    assert summary["time/rollout_s"] > 0.0 and summary["time/reward_s"] > 0.0
    if mode == "colocated":  # each engine loads the whole policy from the learner rank beside it (pairwise
        # with two controllers, one controller's two pairs in single mode): the step's bytes are every engine's
        policy = tmp_path / f"{mode}-{controller}" / "models" / "policy" / "model.safetensors"
        assert summary["sync/bytes"] == devices * _tensor_bytes(policy) > 0


def _tensor_bytes(path) -> int:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        names = f.keys()  # a safe_open handle is no mapping: it has keys() but cannot be iterated
        return sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in names)  # float32 on the CPU


@pytest.mark.parametrize("controller", ["parallel", "single"])
def test_dynamic_moves_devices_toward_a_slow_judge(ray_session, tmp_path, controller):
    """A judge made slow starts with one device of four; the re-planner moves rollout devices to it at a
    weight-sync boundary, no step is lost, every sample is of the current policy version (the step checks it).

    The judge is slow by construction, not by luck: not warm-started and unconstrained, it writes all of its 24
    tokens for each of 16 verdicts per response (256 sequences a step on one device), while the warm-started
    policy answers in a few tokens on three. Controllers do not wait for the driver, whose heartbeat (every
    0.2 s here) carries the step reports the re-planner reads, so a move decided after step s lands a step or
    two later: 8 steps leave room (a CI run with 4 steps of 0.3 s finished before the first move landed)."""
    cfg = small(
        "tiny_cpu",
        "dynamic",
        controller,
        devices=4,
        rollout_replicas=3,
        replan=ReplanConfig(patience=1, gap_threshold=0.1, min_gain=0.01, cooldown=0),
    )
    replace = msgspec.structs.replace
    judge = replace(cfg.rewards[-1].judge, num_samples=16, max_new_tokens=24, choices=msgspec.UNSET)
    cfg = replace(
        cfg,
        judge=replace(cfg.judge, warm_start="none", warm_start_steps=0),
        rewards=[*cfg.rewards[:-1], replace(cfg.rewards[-1], judge=judge)],
        run=replace(cfg.run, num_steps=8),
        controller=replace(cfg.controller, heartbeat_interval_s=0.2),
    )
    summary = run(cfg, tmp_path, f"dynamic-{controller}")
    check(summary, cfg)
    assert summary["time/rollout_s"] > 0.0 and summary["time/reward_s"] > 0.0
    if controller == "parallel":  # partial with parallel controllers: only step reports reach the driver
        # (8 steps of reports and the re-planner's plans: 125 kB measured; a step's samples alone are more)
        assert summary["driver_bytes"] < 300_000, summary["driver_bytes"]
    else:  # step 0, before any move (partial: rollout on devices 0-2, the judge on 3): the one controller's
        # 16 samples go out in chunks, and the judge takes the first while later ones still generate
        rows = [json.loads(line) for line in (tmp_path / f"dynamic-{controller}" / "metrics.jsonl").open()]
        assert rows[0]["time/judge_started_before_rollout_end"] == 1.0, rows[0]
        assert rows[0]["time/rollout_reward_overlap_s"] > 0.0, rows[0]
    decisions = [json.loads(line) for line in (tmp_path / f"dynamic-{controller}" / "placement.jsonl").open()]
    assert len(decisions) == cfg.run.num_steps, decisions
    first = decisions[0]  # the judge's device was the busiest, by far
    assert first["busy_s_per_device"]["genrm"] > 2 * first["busy_s_per_device"]["rollout"], decisions
    assert any(d["moved"] for d in decisions), decisions
    assert summary["placement/moves"] >= 1, decisions
    assert summary["placement/judge_devices"] > 1 and summary["placement/rollout_devices"] < 3


@pytest.mark.parametrize(
    ("preset", "mode", "controller", "devices", "plan"),
    [
        (
            "tiny_cpu_dapo",
            "disaggregated",
            "single",
            3,
            {"actor": [[0]], "rollout": [[1], [2]], "reward": [[1], [2]]},
        ),
        # one parallel controller, a device for each of actor, critic and rollout (its rule reward beside it);
        # two PPO controllers run colocated in test_dapo_ppo.py
        (
            "tiny_cpu_ppo",
            "disaggregated",
            "parallel",
            3,
            {"actor": [[0]], "critic": [[1]], "rollout": [[2]], "reward": [[2]]},
        ),
    ],
)
def test_dapo_and_ppo_outside_the_default_layout(
    ray_session, tmp_path, preset, mode, controller, devices, plan
):
    cfg = small(preset, mode, controller, devices=devices, controllers=1)
    assert {r.role: r.replicas for r in placement_plan(cfg, find(cfg.app)).roles} == plan
    check(run(cfg, tmp_path, f"{preset}-{mode}-{controller}"), cfg)


def test_plan_calibrate_fits_a_runs_phase_times_and_predicts_every_split(tmp_path, capsys):
    """`yatt plan --calibrate RUN_DIR` on a run folder whose phase times were made by a known machine model
    (no job runs): the fit reproduces the run and predicts each split as that model does."""
    import os

    from yatt_apps.cli.main import calibration_shape, main
    from yatt_apps.overlay import to_yaml
    from yatt_placement.machine import MachineModel, step_time
    from yatt_placement.planner import lay_out, plan

    cfg = small("tiny_cpu", "colocated", "single", devices=4)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, prompts_per_step=8))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    rows = [{"rollout/response_len_mean": 3.0}]
    shape = calibration_shape(cfg, rows)
    units = len(os.sched_getaffinity(0))
    truth = MachineModel(physical_units=units, iteration_s=0.004, token_s=1e-5, trainer_s=0.1, sync_s=0.01)
    roles, cluster = find("grpo").roles(cfg), cfg.placement.cluster
    ran = step_time(truth, shape, plan(cluster, roles, "colocated"))
    full = 1 / truth.rate(4)  # wall seconds of a phase on every device
    row = {
        "rollout/response_len_mean": 3.0,
        "time/rollout_s": ran.rollout_s,
        "time/reward_s": ran.reward_s,
        "time/rollout_reward": ran.rollout_reward_s,
        "time/weight_sync": 0.01 * full,
        "time/step": ran.rollout_reward_s + 0.11 * full,
    }
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for _ in range(3)) + "\n")
    assert main(["plan", "--calibrate", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_s"]["colocated"] == pytest.approx(ran.step_s, rel=1e-4)
    for rollout in (1, 2, 3):
        split = lay_out(cluster, roles, "partial", {"actor": 4, "rollout": rollout, "genrm": 4 - rollout})
        key = f"partial rollout {rollout} / judge {4 - rollout}"
        assert out["step_s"][key] == pytest.approx(step_time(truth, shape, split).step_s, rel=1e-3)
    assert out["best"] == min(out["step_s"], key=out["step_s"].get)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["plan", "--calibrate", str(tmp_path)]) == 2
    assert "has 1 logged steps; it needs 2 or more" in capsys.readouterr().err
