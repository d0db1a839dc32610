"""A discrete-event simulator of RL steps under a `PlacementPlan`.

One step: dynamic-sampling waves (PAPERS.md "Dynamic sampling": request ceil(gap x expansion x 1.2) prompts,
keep groups whose rewards differ, at most 1 + max_refill waves, expansion an EMA of total/valid), each wave
generating long-tailed (log-normal) responses and, with a GenRM, K judgements per response; then old/reference
logprobs and `num_updates` training passes on the trainer's devices, and the weight sync.

Engines are simulated per sequence event with continuous batching: an engine of a model with P parameters
on mp devices advances all its active sequences one token per iteration of
    t_iter(a) = overhead + (2P / mp) / memory_bandwidth + a x (2P / mp) / (flops x mfu)
(a fixed per-iteration overhead, reading the weights, and compute per active sequence) and a joining sequence
first costs its prefill, (tokens x 2P / mp) / (flops x mfu). Requests go to engines
round-robin in arrival order, at most `max_num_seqs` in flight per engine.

Modes differ in where the waiting happens:
- colocated: per wave, wake rollout, generate on all devices, sleep it, wake the GenRM, judge, sleep it;
  then the trainer onloads, trains on all devices and offloads. Swaps cost bytes / host bandwidth + a wake
  overhead.
- partial / dynamic: rollout and GenRM wake once per step on their own devices; every finished response
  streams to the GenRM at once, so judging overlaps the generation tail and no swap separates waves.
- disaggregated: no swaps; the trainer waits for rollout (on-policy) and the weights cross the network.
A model, not a measurement: the figures are as good as the hardware and workload numbers in the scenario.
"""

from __future__ import annotations

import heapq
import math
import random

import msgspec

from yatt_placement.memory import estimate_memory_gb
from yatt_placement.planner import role_key
from yatt_placement.types import ClusterSpec, JobProfile, PhaseStats, PlacementMode, PlacementPlan, RoleSpec

GB = 1e9


class Hardware(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Device and link speeds. Defaults: an H20-class device (4.0 TB/s HBM, 148 TFLOP/s bf16)."""

    memory_bandwidth_gbs: float = 4000.0
    flops: float = 148e12
    mfu: float = 0.45  # achieved fraction of peak in prefill, decode compute and training
    host_bandwidth_gbs: float = 25.0  # offload / onload between device and host memory
    wake_overhead_s: float = 3.0  # re-allocating KV cache, graphs, allocator warm-up per engine wake
    network_gbs: float = 25.0  # inter-node broadcast of weights (disaggregated)
    max_num_seqs: int = 256  # concurrent sequences per engine
    iteration_overhead_s: float = 0.005  # per decode iteration: scheduling, sampling, launches (small models
    # are dominated by it, which is what makes the generation tail long)


class Workload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one RL step asks for. Lengths are log-normal with the given median, clipped to the maximum."""

    num_prompts: int = 256
    samples_per_prompt: int = 4
    prompt_tokens: int = 200
    gen_median_tokens: float = 500.0
    gen_sigma: float = 0.9
    gen_max_tokens: int = 4096
    gen_growth_per_step: float = 0.0  # median x (1 + growth x step): responses lengthen during RL
    judgements: int = 8  # K GenRM judgements per response; 0 = rule reward only
    judge_prompt_tokens: int = 300  # grading template around the response
    judge_reads_response: bool = (
        True  # False: an answer verifier that sees the question and final answer only
    )
    judge_median_tokens: float = 250.0
    judge_sigma: float = 0.5
    judge_max_tokens: int = 512
    max_refill: int = 3
    solve_rate_alpha: float = 1.5  # per-prompt solve rate ~ Beta(alpha, beta)
    solve_rate_beta: float = 1.5
    judge_accuracy: float = 0.9  # chance one judgement agrees with the truth
    num_updates: int = 2


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A cluster, its roles (an `actor`, a `rollout`, optional `genrm`s) and a workload to simulate."""

    name: str
    cluster: ClusterSpec
    roles: list[RoleSpec]
    workload: Workload = Workload()
    hardware: Hardware = Hardware()


class StepResult(msgspec.Struct, kw_only=True):
    """One simulated step. `busy_device_s` per role key: device-seconds of useful work (an engine's decode
    iteration counts in proportion to its batch fill up to saturation, prefill and training fully);
    idle = 1 - sum(busy) / (devices x step time)."""

    step: int
    step_time_s: float
    rollout_time_s: float  # generation + judging (+ swaps between them), all waves
    train_time_s: float  # logprobs + updates + swaps + weight sync
    busy_device_s: dict[str, float]
    num_devices: dict[str, int]
    num_waves: int
    idle_fraction: float

    def phase_stats(self) -> PhaseStats:
        """What a controller would report: mean busy seconds per device of each role."""
        busy = {key: value / self.num_devices[key] for key, value in self.busy_device_s.items()}
        return PhaseStats(
            step=self.step, step_time_s=self.step_time_s, busy_s=busy, num_devices=dict(self.num_devices)
        )


class EngineGroup:
    """The engines of one role in a plan, with their speed model."""

    def __init__(self, spec: RoleSpec, replicas: list[list[int]], hw: Hardware) -> None:
        mp = spec.model_parallel_size
        self.count, self.mp, self.key = len(replicas), mp, role_key(spec)
        weights_read = 2 * spec.num_params / mp / (hw.memory_bandwidth_gbs * GB)
        self.base = hw.iteration_overhead_s + weights_read  # s per iteration
        self.per_seq = 2 * spec.num_params / mp / (hw.flops * hw.mfu)  # s per sequence per iteration
        self.prefill = self.per_seq  # s per prompt token
        # Batch at which per-sequence compute equals the fixed cost of an iteration: below it an engine is
        # latency-bound and counts as busy only in proportion to its batch (an iteration with 1 of 64
        # sequences does 1/64 of the work it could). This is what "busy" means throughout.
        self.saturation = max(1.0, self.base / self.per_seq)
        self.max_seqs = hw.max_num_seqs

    def serve(self, jobs: list[tuple[float, int, int, int]]) -> tuple[list[float], float]:
        """jobs: (arrival s, prefill tokens, decode tokens, request id). Requests (e.g. the K judgements of one
        response, sent as one request with n = K) go to engines round-robin in arrival order. Returns each
        job's finish time and the busy device-seconds of all engines."""
        first_seen: dict[int, int] = {}
        for i in sorted(range(len(jobs)), key=lambda i: (jobs[i][0], i)):
            first_seen.setdefault(jobs[i][3], len(first_seen))
        per_engine: list[list[tuple[float, int, int, int]]] = [[] for _ in range(self.count)]
        for i in sorted(range(len(jobs)), key=lambda i: (jobs[i][0], i)):
            arrival, prefill, decode, request = jobs[i]
            per_engine[first_seen[request] % self.count].append((arrival, prefill, decode, i))
        finish = [0.0] * len(jobs)
        busy = sum(self._serve_one(mine, finish) for mine in per_engine)
        return finish, busy * self.mp

    def _serve_one(self, jobs: list[tuple[float, int, int, int]], finish: list[float]) -> float:
        t = clock = busy = 0.0  # wall time; tokens decoded by every active sequence so far
        active: list[tuple[float, int]] = []  # (clock at which it finishes, job index)
        i = 0
        while i < len(jobs) or active:
            while i < len(jobs) and jobs[i][0] <= t and len(active) < self.max_seqs:
                _, prefill, decode, index = jobs[i]
                i += 1
                t += prefill * self.prefill
                busy += prefill * self.prefill
                heapq.heappush(active, (clock + decode, index))
            if not active:
                t = max(t, jobs[i][0])
                continue
            per_token = self.base + self.per_seq * len(active)
            fill = min(1.0, len(active) / self.saturation)
            done_at = t + (active[0][0] - clock) * per_token
            if i < len(jobs) and len(active) < self.max_seqs and jobs[i][0] < done_at:
                arrival = max(jobs[i][0], t)
                clock += (arrival - t) / per_token
                busy, t = busy + (arrival - t) * fill, arrival
                continue
            busy, t, clock = busy + (done_at - t) * fill, done_at, active[0][0]
            while active and active[0][0] <= clock:
                finish[heapq.heappop(active)[1]] = t
        return busy


class Simulator:
    """Runs steps of a scenario under plans; keeps the dynamic-sampling EMA and the RNG across steps."""

    def __init__(self, scenario: Scenario, seed: int = 0) -> None:
        self.scenario, self.rng = scenario, random.Random(seed)
        self.expansion = 1.0
        self.specs = {role_key(spec): spec for spec in scenario.roles}

    def step(self, plan: PlacementPlan, step: int) -> StepResult:
        """Simulate step `step` (its number drives length drift) under `plan`."""
        hw, wl = self.scenario.hardware, self.scenario.workload
        engines = {role_key(p): EngineGroup(self.specs[role_key(p)], p.replicas, hw) for p in plan.roles}
        trainer = next(p for p in plan.roles if p.role == "actor")
        rollout = next(e for e in engines.values() if self.specs[e.key].role == "rollout")
        judges = [e for e in engines.values() if self.specs[e.key].role == "genrm"]
        busy = dict.fromkeys(engines, 0.0)
        rollout_time, waves, kept_tokens = self._waves(plan.mode, rollout, judges, busy, step)
        n_train = sum(len(r) for r in trainer.replicas)
        actor = self.specs[role_key(trainer)]
        passes = 2 + 3 * wl.num_updates  # old + reference logprobs (forward), then forward + backward
        compute = kept_tokens * 2 * actor.num_params * passes / (n_train * hw.flops * hw.mfu)
        busy[role_key(trainer)] += compute * n_train
        train_time = compute + self._train_overhead(plan, actor, n_train, rollout, judges)
        step_time = rollout_time + train_time
        devices = {key: sum(len(r) for r in p.replicas) for p in plan.roles for key in [role_key(p)]}
        idle = 1.0 - sum(busy.values()) / (plan.num_devices * step_time)
        return StepResult(
            step=step,
            step_time_s=step_time,
            rollout_time_s=rollout_time,
            train_time_s=train_time,
            busy_device_s=busy,
            num_devices=devices,
            num_waves=waves,
            idle_fraction=idle,
        )

    def _waves(self, mode, rollout, judges, busy, step) -> tuple[float, int, int]:
        wl = self.scenario.workload
        colocated = mode == "colocated"
        # Partial: rollout and GenRMs wake once per step, side by side; disaggregated engines never sleep.
        elapsed = self._wake([rollout, *judges], concurrent=True) if mode in ("partial", "dynamic") else 0.0
        valid = total = waves = kept_tokens = 0
        while valid < wl.num_prompts and waves < 1 + wl.max_refill:
            asked = math.ceil((wl.num_prompts - valid) * self.expansion * 1.2)
            prompts = [self._prompt(step) for _ in range(asked)]
            elapsed += self._wave(colocated, rollout, judges, busy, prompts)
            waves, total = waves + 1, total + asked
            for lengths, ok in prompts:
                if ok and valid < wl.num_prompts:
                    valid += 1
                    kept_tokens += sum(lengths) + wl.prompt_tokens * len(lengths)
        self.expansion = min(10.0, 0.9 * self.expansion + 0.1 * total / max(valid, 1))
        return elapsed, waves, kept_tokens

    def _prompt(self, step: int) -> tuple[list[int], bool]:
        """Response lengths of one prompt's group, and whether the group survives the filter."""
        wl, rng = self.scenario.workload, self.rng
        median = wl.gen_median_tokens * (1 + wl.gen_growth_per_step * step)
        lengths = [
            min(wl.gen_max_tokens, max(1, round(rng.lognormvariate(math.log(median), wl.gen_sigma))))
            for _ in range(wl.samples_per_prompt)
        ]
        rate = rng.betavariate(wl.solve_rate_alpha, wl.solve_rate_beta)
        rewards = []
        for _ in lengths:
            correct: int = rng.random() < rate  # 0/1, or with judges the count that marks it right
            if wl.judgements:
                agree = sum(rng.random() < wl.judge_accuracy for _ in range(wl.judgements))
                correct = agree if correct else wl.judgements - agree
            rewards.append(correct)
        return lengths, len(set(rewards)) > 1

    def _wave(self, colocated, rollout, judges, busy, prompts) -> float:
        """Seconds one wave takes; adds busy device-seconds. Several GenRMs share the responses round-robin."""
        wl = self.scenario.workload
        gen_jobs = [
            (0.0, wl.prompt_tokens, n, i) for i, n in enumerate(n for lengths, _ in prompts for n in lengths)
        ]
        gen_done, gen_busy = rollout.serve(gen_jobs)
        busy[rollout.key] += gen_busy
        gen_time = max(gen_done)
        # Colocated: wake rollout, generate, sleep it; then wake each GenRM, judge, sleep it.
        swaps = self._wake([rollout], concurrent=False) + self._swap(rollout) if colocated else 0.0
        if not judges:
            return gen_time + swaps
        start = gen_time + self._wake(judges, concurrent=False) if colocated else 0.0
        judge_jobs = []
        for (_, _, length, request), done in zip(gen_jobs, gen_done, strict=True):
            arrival = start if colocated else done  # streamed as each response finishes
            for k in range(wl.judgements):  # the K samples share the prompt's prefill (prefix cache)
                read = length if wl.judge_reads_response else 0
                prefill = wl.judge_prompt_tokens + read if k == 0 else 0
                judge_jobs.append((arrival, prefill, self._judge_length(), request))
        end = gen_time
        for index, judge in enumerate(judges):
            mine = [job for job in judge_jobs if job[3] % len(judges) == index]
            done, judge_busy = judge.serve(mine)
            busy[judge.key] += judge_busy
            end = max(end, *done)
        return end + swaps + (sum(self._swap(j) for j in judges) if colocated else 0.0)

    def _judge_length(self) -> int:
        wl = self.scenario.workload
        draw = self.rng.lognormvariate(math.log(wl.judge_median_tokens), wl.judge_sigma)
        return min(wl.judge_max_tokens, max(1, round(draw)))

    def _swap(self, engines: EngineGroup) -> float:
        """Seconds to move one engine's weights between device and host."""
        weights = 2 * self.specs[engines.key].num_params / engines.mp
        return weights / (self.scenario.hardware.host_bandwidth_gbs * GB)

    def _wake(self, engines: list[EngineGroup], *, concurrent: bool) -> float:
        costs = [self._swap(e) + self.scenario.hardware.wake_overhead_s for e in engines]
        return (max(costs) if concurrent else sum(costs)) if costs else 0.0

    def _train_overhead(self, plan, actor: RoleSpec, n_train: int, rollout, judges) -> float:
        """Swaps around training and the weight sync."""
        hw = self.scenario.hardware
        weights = 2 * actor.num_params
        if plan.mode == "disaggregated":
            return weights / (hw.network_gbs * GB)
        state = estimate_memory_gb(actor, n_train, activation_gb=0.0) * GB
        onload_offload = 2 * state / (hw.host_bandwidth_gbs * GB)
        sync = weights / rollout.mp / (hw.memory_bandwidth_gbs * GB)  # in-process copy per engine
        sleep = 0.0 if plan.mode == "colocated" else max(self._swap(e) for e in [rollout, *judges])
        return onload_offload + sync + sleep


def profile(
    scenario: Scenario, placement: PlacementPlan | None = None, *, num_steps: int = 1, seed: int = 0
) -> JobProfile:
    """Profile a scenario the way a user would: run `num_steps` under `placement` (default: full
    colocation) and average each role's busy device-seconds (`JobProfile.from_stats`)."""
    from yatt_placement.planner import plan

    simulator = Simulator(scenario, seed=seed)
    placement = placement or plan(scenario.cluster, scenario.roles, "colocated")
    stats = [simulator.step(placement, step).phase_stats() for step in range(num_steps)]
    return JobProfile.from_stats(stats)


def profiled_plan(
    scenario: Scenario, mode: PlacementMode, *, rounds: int = 2, seed: int = 0
) -> PlacementPlan:
    """Plan from a profile, then re-profile under that plan and plan again (`rounds` times in all).

    Busy time measured under full colocation overstates a role whose engines are latency-bound there (a small
    policy spread over every device); measuring again under the candidate split corrects most of it.
    """
    from yatt_placement.planner import plan

    placement = None
    for _ in range(rounds):
        measured = profile(scenario, placement, seed=seed)
        placement = plan(scenario.cluster, scenario.roles, mode, profile=measured)
    if placement is None:
        raise ValueError(f"profiled_plan needs rounds >= 1, got {rounds}")
    return placement
