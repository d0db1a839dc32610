"""YATT's controller hosting your classes: your own sampler and trainer (plain Python and torch, nothing from
YATT's engines or learners) placed by yatt-placement and driven by yatt-controller's parallel controllers
running your step function, with a checkpoint, a stop and a resume.

The task is a tabular policy: 16 prompts, 4 answers each, reward 1 when the answer is `prompt % 4`. Your
`TableSampler` samples answers from softmax(logits[prompt]); your `TableTrainer` computes the REINFORCE
gradient (per-prompt mean baseline) of its share of the batch and applies the summed gradient with SGD.
yatt-placement colocates both roles on 2 logical devices of a local Ray; there are 2 parallel controllers,
one per trainer rank, each drawing its own shard of every global batch of 8 prompts. Your step function:

    sample (your sampler's replica on this controller's device) -> check policy versions ->
    gradient (your trainer rank) -> all-reduce among the controllers -> apply -> push weights (colocated)

The YATT parts: `plan` + `realize` (where the roles run), `WorkerGroup.create` (your classes hosted per
device), `WeightSync(mode="colocated")` (your `named_weights` -> your `load_weights`), `ctx.rng` and
`ctx.state` (checkpointed), your `checkpoint_state` / `load_checkpoint_state` (called at each checkpoint),
and `run(ControllerSpec(mode="parallel"), Job(...))`.
The example runs 4 steps straight, then 2 steps into another directory, stops, and resumes that run to step
4: the resumed steps draw the same prompts, sample the same answers and reach the same weights.

    uv run python examples/controller_hosts_your_classes.py

The last printed line is one JSON object.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from pathlib import Path

# Before Ray starts: no auth token under $HOME, no usage stats, and under `uv run` Ray must not package the
# checkout as every worker's working directory (its workers run this same interpreter).
for _key in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_UV_RUN_RUNTIME_ENV"):
    os.environ.setdefault(_key, "disabled" if _key == "RAY_AUTH_MODE" else "0")

NUM_PROMPTS, NUM_ANSWERS, SAMPLES, BATCH, LR = 16, 4, 4, 8, 2.0
STEPS, STOP_AT = 4, 2


# ---- your classes: nothing from YATT ------------------------------------------------------------------


class TableSampler:
    """Your rollout class: samples answers from the policy's table; stamps each sample with its version."""

    def __init__(self) -> None:
        import torch

        self.logits, self.version = torch.zeros(NUM_PROMPTS, NUM_ANSWERS), 0

    def generate(self, prompts: list[int], seed: int) -> list[dict]:
        import torch

        gen = torch.Generator().manual_seed(seed)
        answers = torch.multinomial(
            self.logits[prompts].softmax(-1), SAMPLES, replacement=True, generator=gen
        )
        return [
            {"prompt": p, "answer": a, "reward": float(a == p % NUM_ANSWERS), "version": self.version}
            for p, row in zip(prompts, answers.tolist(), strict=True)
            for a in row
        ]

    def load_weights(self, named: list, version: int) -> None:  # weight sync's receiving end
        self.logits.copy_(dict(named)["logits"])
        self.version = version


class TableTrainer:
    """Your trainer class: one rank of a data-parallel REINFORCE learner over the same table."""

    def __init__(self, worker_info=None) -> None:
        import torch

        self.logits = torch.zeros(NUM_PROMPTS, NUM_ANSWERS, requires_grad=True)
        self.rank = worker_info.dp_rank  # YATT passes the rank this instance holds

    def gradient(self, samples: list[dict], num_global: int) -> list[float]:
        """d(loss)/d(logits) of this rank's samples, the loss being a mean over all `num_global` samples."""
        import torch

        prompts = torch.tensor([s["prompt"] for s in samples])
        answers = torch.tensor([s["answer"] for s in samples])
        rewards = torch.tensor([s["reward"] for s in samples])
        baseline = rewards.view(-1, SAMPLES).mean(-1).repeat_interleave(SAMPLES)  # samples come per prompt
        logp = self.logits.log_softmax(-1)[prompts, answers]
        loss = -((rewards - baseline) * logp).sum() / num_global
        (grad,) = torch.autograd.grad(loss, self.logits)
        return grad.reshape(-1).tolist()

    def apply(self, gradient: list[float]) -> float:
        import torch

        with torch.no_grad():
            self.logits -= LR * torch.tensor(gradient).view_as(self.logits)
        return float(self.logits.detach().abs().sum())

    def named_weights(self) -> list:  # weight sync's sending end
        return [("logits", self.logits.detach())]

    def checkpoint_state(self) -> bytes:
        import torch

        buffer = io.BytesIO()
        torch.save(self.logits.detach().clone(), buffer)
        return buffer.getvalue()

    def load_checkpoint_state(self, data: bytes) -> None:
        import torch

        with torch.no_grad():
            self.logits.copy_(torch.load(io.BytesIO(data)))


# ---- your step function: what each controller runs, once per step ------------------------------------------


def step(ctx, prompts: list[int]) -> dict[str, float]:
    seed = ctx.rng.randrange(2**31)  # ctx.rng is checkpointed: a resumed run draws the same seeds
    with ctx.phase("rollout"):
        (samples,) = ctx.get(ctx.services["rollout"].scatter("generate", prompts, seed=seed))
    ctx.check_versions([s["version"] for s in samples])  # never train on another policy's samples
    with ctx.phase("train"):
        num_global = int(ctx.all_reduce({"n": len(samples)})["n"])
        (grad,) = ctx.get(ctx.learner.broadcast("gradient", samples, num_global))
        summed = ctx.all_reduce({str(i): g for i, g in enumerate(grad)})  # small: 64 floats
        (weights_l1,) = ctx.get(ctx.learner.broadcast("apply", [summed[str(i)] for i in range(len(grad))]))
    ctx.sync_weights()  # the sampler next to each trainer rank loads its weights as the next version
    totals = ctx.all_reduce({"reward": sum(s["reward"] for s in samples), "n": len(samples)})
    ctx.state["samples_seen"] = ctx.state.get("samples_seen", 0) + len(samples)  # checkpointed too
    rows = {f"prompt_{i}": float(p) for i, p in enumerate(prompts)}
    answers = sum((k + 1) * s["answer"] for k, s in enumerate(samples))  # order-sensitive fingerprint
    return {
        **rows,
        "reward_mean": totals["reward"] / totals["n"],
        "weights_l1": weights_l1,
        "answers_fingerprint": answers,
        "samples_seen": ctx.state["samples_seen"],
    }


def prompts() -> list[int]:
    return list(range(NUM_PROMPTS))


# ---- YATT: placement, hosting, the run --------------------------------------------------------------------


def build(pool):
    """Called on every (re)start: hosts your classes on the plan's devices."""
    from yatt_controller.runner import Services
    from yatt_controller.sync import WeightSync
    from yatt_controller.worker_group import WorkerGroup

    trainer = WorkerGroup.create(pool, "actor", TableTrainer, pass_worker_info=True)
    sampler = WorkerGroup.create(pool, "rollout", TableSampler)
    sync = WeightSync(trainer, [sampler], mode="colocated")
    return Services(groups={"actor": trainer, "rollout": sampler}, learner="actor", weight_sync=sync)


def placement():
    from yatt_placement.planner import plan
    from yatt_placement.types import ClusterSpec, RoleSpec

    cluster = ClusterSpec(num_nodes=1, devices_per_node=2, device_memory_gb=1.0)
    roles = [
        RoleSpec(role="actor", num_params=NUM_PROMPTS * NUM_ANSWERS, trainable=True, memory_gb=0.1),
        RoleSpec(role="rollout", num_params=NUM_PROMPTS * NUM_ANSWERS, memory_gb=0.1),
    ]
    return plan(cluster, roles, "colocated")


def run_steps(realized, num_steps: int, checkpoint_dir: str | None) -> dict[int, list]:
    from yatt_controller.runner import Job, run
    from yatt_controller.types import ControllerSpec

    spec = ControllerSpec(
        mode="parallel",
        num_controllers=2,
        checkpoint_every=1 if checkpoint_dir else 0,
        heartbeat_interval_s=0.5,
    )
    job = Job(
        build=build,
        step_fn=step,
        dataset=prompts,
        batch_size=BATCH,
        num_steps=num_steps,
        checkpoint_dir=checkpoint_dir,
    )
    result = run(spec, job, realized)
    return {s: [r.metrics for r in reports] for s, reports in sorted(result.reports.items())}


def main(argv: list[str] | None = None) -> dict:
    import ray
    from yatt_placement.realize import realize, release

    del argv  # no options
    # a program with a Ray session of its own (2 logical GPUs free) lends it; else a local Ray for this run
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=8, num_gpus=2, include_dashboard=False, object_store_memory=256 << 20
        )
    try:
        realized = realize(placement(), cpus_per_device=1.0)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                straight = run_steps(realized, STEPS, None)
                first = run_steps(realized, STOP_AT, str(Path(tmp) / "ckpt"))
                resumed = run_steps(realized, STEPS, str(Path(tmp) / "ckpt"))
        finally:
            release(realized)
    finally:
        if started:
            ray.shutdown()
    devices = {p.role: p.replicas for p in realized.plan.roles}
    result = {
        "placement": devices,
        "straight_steps": sorted(straight),
        "first_steps": sorted(first),
        "resumed_steps": sorted(resumed),
        "straight": {str(s): m for s, m in straight.items()},
        "resumed": {str(s): m for s, m in resumed.items()},
        "resume_matches": all(resumed[s] == straight[s] for s in resumed),
        "reward_mean": [straight[s][0]["reward_mean"] for s in sorted(straight)],
    }
    print(f"placement (devices per replica): {devices}")
    for s, metrics in straight.items():
        batch = [[int(m[f"prompt_{i}"]) for i in range(BATCH // 2)] for m in metrics]
        again = "" if s not in resumed else f"   resumed: {resumed[s] == metrics}"
        print(f"step {s}: prompts per controller {batch}, reward {metrics[0]['reward_mean']:.3f}{again}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
