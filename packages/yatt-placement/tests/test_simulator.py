"""The step simulator: hand-worked engine timings, busy/idle accounting, and the paper-shaped result that
partial colocation shortens rollout against full colocation."""

import pytest
from yatt_placement.planner import lay_out, plan
from yatt_placement.replanner import DynamicReplanner
from yatt_placement.scenarios import SCENARIOS, get_scenario
from yatt_placement.simulator import EngineGroup, Hardware, Simulator, profile, profiled_plan
from yatt_placement.types import RoleSpec

# A 1e9-parameter model on one device: reading 2 GB at 2000 GB/s = 1 ms per iteration; 2 GFLOP per token at
# 2 TFLOP/s = 1 ms per sequence per iteration (and per prefill token). Saturation batch = 1 / 1 = 1.
UNIT = Hardware(memory_bandwidth_gbs=2000.0, flops=2e12, mfu=1.0, iteration_overhead_s=0.0, max_num_seqs=8)
MODEL = RoleSpec(role="rollout", num_params=1e9)


def test_continuous_batching_hand_worked():
    engines = EngineGroup(MODEL, [[0]], UNIT)
    # Two sequences from t=0, 10 and 20 tokens: 2 active -> 3 ms per token, the first ends at 10 x 3 = 30 ms;
    # then 1 active -> 2 ms per token for the remaining 10: 50 ms. Busy (batch >= saturation) all 50 ms.
    finish, busy = engines.serve([(0.0, 0, 10, 0), (0.0, 0, 20, 1)])
    assert finish == pytest.approx([0.030, 0.050])
    assert busy == pytest.approx(0.050)
    # One at t=0 (10 tokens), one arriving at 5 ms (5 tokens): alone 2 ms/token -> 2.5 tokens by 5 ms; together
    # 3 ms/token, the second ends after 5 tokens at 20 ms; the first has 2.5 left alone: 25 ms.
    finish, _ = engines.serve([(0.0, 0, 10, 0), (0.005, 0, 5, 1)])
    assert finish == pytest.approx([0.025, 0.020])
    # A 100-token prefill blocks for 100 x 1 ms, then 4 tokens alone at 2 ms: 0.108 s.
    finish, busy = engines.serve([(0.0, 100, 4, 0)])
    assert finish == pytest.approx([0.108]) and busy == pytest.approx(0.108)


def test_requests_round_robin_over_engines_and_idle_gaps_are_not_busy():
    engines = EngineGroup(MODEL, [[0], [1]], UNIT)
    # Requests 0, 1, 2 in arrival order go to engines 0, 1, 0. Request 2 arrives at 1 s, after engine 0 went
    # idle (its first job ended at 10 x 2 ms = 20 ms): it ends at 1 + 0.020.
    finish, busy = engines.serve([(0.0, 0, 10, 0), (0.0, 0, 10, 1), (1.0, 0, 10, 2)])
    assert finish == pytest.approx([0.020, 0.020, 1.020])
    assert busy == pytest.approx(0.060)  # three 20 ms runs; the 0.98 s gap is idle


def test_latency_bound_engines_count_busy_by_batch_fill():
    # Overhead 3 ms per iteration: base 4 ms, per sequence 1 ms -> saturation batch 4. One sequence of 10 tokens
    # takes 10 x 5 ms = 50 ms but counts 50 x 1/4 = 12.5 ms busy.
    hardware = Hardware(memory_bandwidth_gbs=2000.0, flops=2e12, mfu=1.0, iteration_overhead_s=0.003)
    finish, busy = EngineGroup(MODEL, [[0]], hardware).serve([(0.0, 0, 10, 0)])
    assert finish == pytest.approx([0.050]) and busy == pytest.approx(0.0125)


def test_max_num_seqs_queues_the_rest():
    engines = EngineGroup(MODEL, [[0]], Hardware(**{**_fields(UNIT), "max_num_seqs": 1}))
    # One at a time, 2 ms per token: 20 ms, then 40 ms.
    finish, _ = engines.serve([(0.0, 0, 10, 0), (0.0, 0, 10, 1)])
    assert finish == pytest.approx([0.020, 0.040])


def _fields(struct):
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


@pytest.fixture(scope="module")
def paper():
    return get_scenario("paper", num_prompts=64)


def test_step_accounting_adds_up(paper):
    colocated = plan(paper.cluster, paper.roles, "colocated")
    result = Simulator(paper, seed=3).step(colocated, 0)
    assert result.step_time_s == pytest.approx(result.rollout_time_s + result.train_time_s)
    assert result.num_devices == {"actor": 64, "rollout": 64, "judge": 64}
    assert 0.0 < result.idle_fraction < 1.0
    total_busy = sum(result.busy_device_s.values())
    assert result.idle_fraction == pytest.approx(1 - total_busy / (64 * result.step_time_s))
    # The trainer is busy for its compute; the rest of the train phase is swapping and the weight sync:
    # onload + offload of 1.5e9 x (2 + 6 + 1 + 12 / 64) B = 13.78 GB at 25 GB/s = 2 x 0.55125 s, plus the
    # in-device copy of 3 GB of bf16 weights at 4000 GB/s = 0.00075 s.
    compute = result.busy_device_s["actor"] / 64
    assert result.train_time_s - compute == pytest.approx(2 * 13.78125 / 25 + 0.00075)
    assert result.phase_stats().busy_s["actor"] == pytest.approx(compute)


def test_same_seed_same_steps(paper):
    partial = lay_out(paper.cluster, paper.roles, "partial", {"rollout": 8, "judge": 56})
    first = [Simulator(paper, seed=5).step(partial, s) for s in range(2)]
    again = [Simulator(paper, seed=5).step(partial, s) for s in range(2)]
    assert first == again
    assert Simulator(paper, seed=6).step(partial, 0) != first[0]


def test_partial_beats_full_colocation_on_the_paper_shape(paper):
    chosen = profiled_plan(paper, "partial")
    assert [len(r) for r in chosen.roles[1].replicas] == [1] * 8  # rollout on 8 devices, judge on 56
    colocated = plan(paper.cluster, paper.roles, "colocated")
    full = [Simulator(paper, seed=s).step(colocated, 0) for s in range(2)]
    part = [Simulator(paper, seed=s).step(chosen, 0) for s in range(2)]
    for f, p in zip(full, part, strict=True):
        assert p.rollout_time_s < f.rollout_time_s
        assert p.step_time_s < f.step_time_s


def test_disaggregated_trainer_idles_during_rollout(paper):
    disaggregated = profiled_plan(paper, "disaggregated")
    result = Simulator(paper, seed=0).step(disaggregated, 0)
    actor_devices = result.num_devices["actor"]
    # Busy only while training, so its share of the step is below the train phase's share.
    assert result.busy_device_s["actor"] / actor_devices < result.train_time_s


def test_profile_is_busy_device_seconds(paper):
    colocated = plan(paper.cluster, paper.roles, "colocated")
    measured = profile(paper, colocated, num_steps=1, seed=2)
    result = Simulator(paper, seed=2).step(colocated, 0)
    assert measured.device_seconds == pytest.approx(result.busy_device_s)


def test_no_judge_scenario_runs_colocated_and_refuses_partial():
    scenario = get_scenario("no-judge", num_prompts=16)
    result = Simulator(scenario).step(plan(scenario.cluster, scenario.roles, "colocated"), 0)
    assert set(result.busy_device_s) == {"actor", "rollout"} and result.num_waves >= 1
    with pytest.raises(
        ValueError, match="partial placement needs exactly one 'rollout' role and at least one"
    ):
        plan(scenario.cluster, scenario.roles, "partial")


def test_scenario_registry():
    assert sorted(SCENARIOS) == ["drift", "no-judge", "paper", "paper-8", "single-judge"]
    with pytest.raises(ValueError, match=r"unknown scenario 'huge'; known: \['drift', 'no-judge'"):
        get_scenario("huge")


@pytest.mark.slow
def test_dynamic_beats_the_best_static_split_when_lengths_drift():
    scenario = get_scenario("drift", num_prompts=32, num_steps=32)
    n = scenario.cluster.num_devices
    static = {}
    for s in (2, 4, 6):
        split = lay_out(scenario.cluster, scenario.roles, "partial", {"rollout": s, "judge": n - s})
        simulator = Simulator(scenario, seed=0)
        static[s] = sum(simulator.step(split, step).step_time_s for step in range(32))
    replanner = DynamicReplanner(scenario.cluster, scenario.roles, profiled_plan(scenario, "dynamic"))
    simulator, dynamic = Simulator(scenario, seed=0), 0.0
    for step in range(32):
        result = simulator.step(replanner.plan, step)
        dynamic += result.step_time_s
        replanner.observe(result.phase_stats())
    assert replanner.plan.version >= 1
    assert dynamic < min(static.values())
