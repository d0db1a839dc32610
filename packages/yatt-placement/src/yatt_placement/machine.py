"""The step of a job whose engines take batched calls, on a machine whose logical devices share physical units.

`simulator.Simulator` models a GPU cluster sequence by sequence. The live jobs (yatt_apps) differ in what
decides their step time on small models: prompts travel to the rollout replicas in chunks (two per replica),
each finished chunk becomes one judge call (its responses x K verdicts), a replica runs one call at a time, a
call costs a fixed part (dispatch, batch set-up, the decode loop's per-iteration work) plus a part per row, and
where logical devices outnumber the physical units (4 logical devices on 2 CPU cores), the calls running at
once share those units (processor sharing: each runs at units / busy devices of full speed). The trainer spans
every device in every mode, so its phases (logprobs, updates) and the weight sync cost the same under any
split; full colocation adds the engines' sleep and wake.

`MachineModel` holds those constants, `fit_machine` fits them to one measured run's phase times (the live
colocated run: `time/rollout_s`, `time/reward_s`, the trainer phases), and `step_time` predicts any plan.
A model, fitted to one machine at one load: its figures hold for the batch shapes and load it was fitted at.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from yatt_placement.types import PlacementPlan

ROLLOUT, JUDGE = "rollout", "judge"


class MachineModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Constants of one machine, in seconds at full speed of one physical unit. An engine call that decodes
    `iterations` tokens for `rows` sequences holding `tokens` tokens in all costs
        iterations x iteration_s + tokens x token_s
    (the decode loop's fixed work per iteration: sampling, launches, Python; and the model's work per token,
    prefill and decode alike: on small models attention over a short context is nearly linear in tokens)."""

    physical_units: int  # compute units the logical devices share (CPU cores; devices on a GPU cluster)
    iteration_s: float
    token_s: float
    # per step, at full speed of every device (the trainer spans them all): logprobs, updates, advantages and
    # what else runs outside the rollout/judge stream; the weight sync; full colocation's sleep and wake
    trainer_s: float = 0.0
    sync_s: float = 0.0
    swap_s: float = 0.0
    # other work on the machine: how many other process groups had runnable threads while the run went. Linux
    # shares the units between groups first (sched_autogroup: one group per session; a job's processes are
    # one), then between a group's threads: this job's busy devices get units / (1 + background_load) in all
    background_load: float = 0.0

    def rate(self, busy_devices: int) -> float:
        """Speed of each of `busy_devices` logical devices working at once, as a fraction of full speed."""
        return min(1.0, self.physical_units / (max(busy_devices, 1) * (1.0 + self.background_load)))

    def __post_init__(self) -> None:
        if self.physical_units < 1:
            raise ValueError(f"MachineModel.physical_units must be >= 1, got {self.physical_units}")
        for field in ("iteration_s", "token_s", "trainer_s", "sync_s", "swap_s", "background_load"):
            if not getattr(self, field) >= 0:  # also rejects NaN
                raise ValueError(f"MachineModel.{field} must be >= 0, got {getattr(self, field)}")


class CallShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one step sends: prompts x samples to the rollout, each sample judged `judgements` times (the K
    verdicts of a sample are K rows of one judge call, each reading the whole judge prompt)."""

    num_prompts: int
    samples_per_prompt: int
    judgements: int
    prompt_tokens: float  # a chat-templated prompt
    response_tokens: float  # mean response length
    max_response_tokens: float  # decode iterations of a rollout call (its longest response)
    judge_prompt_tokens: float  # the grading template around prompt, answer and response
    verdict_tokens: float  # decode iterations of a judge call
    chunks_per_replica: int = 2  # yatt_apps.runtime.phases.num_chunks

    def num_chunks(self, rollout_replicas: int) -> int:
        return max(1, min(self.num_prompts, self.chunks_per_replica * rollout_replicas))

    def work(self, model: MachineModel, kind: str, rows: int) -> float:
        """Seconds at full speed of one call of `kind` with `rows` sequences."""
        if kind == ROLLOUT:
            tokens = rows * (self.prompt_tokens + self.response_tokens)
            return self.max_response_tokens * model.iteration_s + tokens * model.token_s
        tokens = rows * (self.judge_prompt_tokens + self.response_tokens + self.verdict_tokens)
        return self.verdict_tokens * model.iteration_s + tokens * model.token_s


class StepPrediction(msgspec.Struct, kw_only=True):
    """One predicted step: its time and parts, and each engine role's busy device-seconds."""

    step_s: float
    rollout_s: float  # first rollout call sent -> last rollout call done
    reward_s: float  # first judge call sent -> last judge call done
    rollout_reward_s: float
    busy_device_s: dict[str, float]


class _Call:
    __slots__ = ("devices", "kind", "left", "rows", "submitted")

    def __init__(self, kind: str, devices: list[int], work: float, rows: int, submitted: float) -> None:
        self.kind, self.devices, self.left, self.rows, self.submitted = kind, devices, work, rows, submitted


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _replicas(plan: PlacementPlan, role: str) -> list[list[int]]:
    found = [p for p in plan.roles if p.role == role]
    if not found:
        raise ValueError(f"plan has no {role!r} role; it has {plan.role_keys()}")
    return [list(r) for p in found for r in p.replicas]


def step_time(model: MachineModel, shape: CallShape, plan: PlacementPlan) -> StepPrediction:
    """The predicted step of `shape` under `plan` (roles `rollout` and `genrm`, the trainer spanning all)."""
    rollout = _replicas(plan, "rollout")
    judges = _replicas(plan, "genrm") if shape.judgements else []
    chunks = _split(shape.num_prompts, shape.num_chunks(len(rollout)))
    queues: dict[tuple[str, int], list[_Call]] = {}
    outstanding = {(ROLLOUT, i): 0 for i in range(len(rollout))} | {(JUDGE, i): 0 for i in range(len(judges))}

    def submit(kind: str, replicas: list[list[int]], rows: int, now: float) -> None:
        # the least-loaded replica, ties to the lowest index (WorkerGroup.call_one)
        index = min(range(len(replicas)), key=lambda i: (outstanding[(kind, i)], i))
        work = shape.work(model, kind, rows)
        queues.setdefault((kind, index), []).append(_Call(kind, replicas[index], work, rows, now))
        outstanding[(kind, index)] += 1

    for prompts in chunks:
        submit(ROLLOUT, rollout, prompts * shape.samples_per_prompt, 0.0)
    now, busy = 0.0, {ROLLOUT: 0.0, JUDGE: 0.0}
    first = {ROLLOUT: 0.0, JUDGE: math.inf}
    last = {ROLLOUT: 0.0, JUDGE: 0.0}
    while any(queues.values()):
        running = _running(queues)
        devices = {d for _, call in running for d in call.devices}
        rate = model.rate(len(devices))
        key, call = min(running, key=lambda item: item[1].left)
        elapsed = call.left / rate
        for _, other in running:
            other.left -= elapsed * rate
            busy[other.kind] += elapsed * len(other.devices)
        now += elapsed
        queues[key].pop(0)
        outstanding[key] -= 1
        last[call.kind] = now
        if call.kind == ROLLOUT and judges:
            first[JUDGE] = min(first[JUDGE], now)
            submit(JUDGE, judges, call.rows * shape.judgements, now)
    reward_s = last[JUDGE] - first[JUDGE] if judges else 0.0
    swaps = model.swap_s if plan.sleeps else 0.0
    return StepPrediction(
        step_s=now + (model.trainer_s + model.sync_s + swaps) / model.rate(plan.num_devices),
        rollout_s=last[ROLLOUT],
        reward_s=reward_s,
        rollout_reward_s=now,
        busy_device_s={ROLLOUT: busy[ROLLOUT], JUDGE: busy[JUDGE]},
    )


def _running(queues: dict[tuple[str, int], list[_Call]]) -> list[tuple[tuple[str, int], _Call]]:
    """The calls that run now: each replica's first queued call, unless a device it needs is taken by a call
    of another replica earlier in submission order (one process per device runs one engine call at a time)."""
    taken: set[int] = set()
    running = []
    heads = sorted(((key, q[0]) for key, q in queues.items() if q), key=lambda item: item[1].submitted)
    for key, call in heads:
        if taken.isdisjoint(call.devices):
            taken.update(call.devices)
            running.append((key, call))
    return running


def fit_value(target: float, predict: Callable[[float], float], lo: float, hi: float) -> float:
    """The parameter in [lo, hi] (log scale) whose prediction is closest to `target` (predict increasing)."""
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if predict(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def fit_machine(
    measured: dict[str, float],
    shape: CallShape,
    plan: PlacementPlan,
    physical_units: int,
    background_load: float = 0.0,
) -> MachineModel:
    """Constants that reproduce one run's median phase times under its own `plan`, measured while
    `background_load` other processes ran (`MachineModel.background_load`; predict another load by replacing it).

    `measured`: "rollout_s" and "reward_s" (the streaming stages' spans), and the wall seconds per step of
    "trainer_s" (everything outside the stream, sync and swaps excluded), "sync_s", "swap_s".
    A rollout call of a small model is mostly decode iterations and a judge call mostly tokens (long grading
    prompts, a short verdict), so `iteration_s` is fitted to the rollout's span and `token_s` to the judge's,
    in turn (each moves both spans a little), four rounds."""
    for key in ("rollout_s", "reward_s"):
        if not measured.get(key, 0.0) > 0:
            raise ValueError(f"fit_machine needs a measured {key} > 0, got {measured.get(key)}")
    full = min(1.0, physical_units / (plan.num_devices * (1.0 + background_load)))  # the trainer's speed then
    model = MachineModel(
        physical_units=physical_units,
        iteration_s=1e-3,
        token_s=1e-5,
        trainer_s=measured.get("trainer_s", 0.0) * full,
        sync_s=measured.get("sync_s", 0.0) * full,
        swap_s=measured.get("swap_s", 0.0) * full,
        background_load=background_load,
    )
    for _ in range(4):
        for field, key in (("iteration_s", "rollout_s"), ("token_s", "reward_s")):

            def predict(
                value: float, field: str = field, key: str = key, base: MachineModel = model
            ) -> float:
                trial = msgspec.structs.replace(base, **{field: value})
                return float(getattr(step_time(trial, shape, plan), key))

            model = msgspec.structs.replace(model, **{field: fit_value(measured[key], predict, 1e-9, 10.0)})
    return model
