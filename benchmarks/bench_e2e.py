"""End-to-end benchmark: YATT's GRPO job against TRL's GRPOTrainer, on the same tiny model, batch and machine.

What is compared. One GRPO step = generate G completions for each of P prompts, score them, compute logprobs
(policy and a frozen reference, KL coefficient 1e-3 in both), group-normalised advantages, one optimizer step
(AdamW, clip 1.0) over the whole batch. Both sides use:
- the same model directory, at two sizes (`--sizes`): `tiny`, the preset's Qwen2 (hidden 64, 2 layers, head_dim
  32, fp32), and `small` (hidden 256, 4 layers, 4 heads of 64, 64 new tokens: generation dominates), each with
  a tokenizer trained locally on the embedded arithmetic task, built once by `yatt_apps.io.models.prepare_model`;
- the same prompts (the embedded arithmetic task, chat-templated by the tokenizer's ChatML template), P prompts
  x G samples per step, at most L new tokens, temperature 1.0, top-p 1.0, no top-k;
- the same reward: math_verify against the answer (weight 1) + a format regex `^\\s*-?\\d+` (weight 0.5), both
  computed by `yatt_multimodal.rules` (in TRL as two reward functions with reward_weights [1, 0.5]); no judge;
- the same update: one optimizer step per batch (YATT `algo.num_updates_per_batch=1`, whole-batch mini- and
  micro-batches; TRL `num_iterations=1`, `steps_per_generation=1`), the whole batch in one forward/backward
  per rank. Both therefore skip the separate old-policy forward (the training forward's detached logprobs are
  the old ones) and run the reference forward beside the update; both run the output projection and
  log-softmax over the completion's tokens only (TRL's `logits_to_keep`, YATT's jobs' default
  `learner.score_prompt_tokens=false`).

YATT runs the real app: `yatt_apps.runtime.launch.run_job` with the `tiny_cpu` preset minus the judge, in each
layout of `--layouts` (`2c2d`: two parallel controllers on two logical devices, a learner rank each over gloo
DDP; `1c1d`: one controller, one device; both colocated, per device a policy learner rank with its reference,
an HF rollout engine and a reward worker; `async1c2d`: disaggregated with bounded staleness 1, the learner on
device 0 and the engine with the rule reward beside it on device 1, generation overlapping the update), all in
one Ray session. A logical device is an equal share of the machine's
cores (`placement.cpus_per_device` = cores / devices: the torch threads of each role on it). The engines keep
their weights between steps (`placement.sleep_level=0`: a CPU has no device memory to hand over). Its step time is the lead controller's
`time/step` (data, rollout, reward, advantages, train with the reference forward, weight sync; not
checkpoints, which are off). TRL runs `GRPOTrainer(use_cpu=True, use_vllm=False)` in this process at each
thread count of `--threads` (default 1 and one per core; on a busy 2-core machine two OpenMP threads can be
many times slower than one), and its best thread count once more after YATT's runs, so a load swing during
one side's turn does not decide the ratio. Its step time is the wall time between the trainer's
`on_step_begin` and `on_step_end` callbacks (generation, reward, logprobs, loss, optimizer step). Each side's
best run is its figure; all are reported.
Throughput = completion tokens (up to and including EOS, as each side counts them: YATT's response mask,
TRL's `completions/mean_length` x P x G) / step seconds: the median over the timed steps after the warm-up
(robust to a step slowed by other work on a shared machine), and the overall figure (sums) beside it.
Start-up (Ray, worker processes, model loads) is excluded on both sides.
Quality beside speed: each run's final reward (mean `reward/mean` of its last 3 steps) is reported,
`sync_final_reward`, `async_final_reward`, `trl_final_reward`. YATT's fixed per-step cost, `yatt_fixed_step_s`:
the best synchronous layout on the `null` model (one layer of width 8: ~no compute) with the same batch and
lengths; `yatt_fixed_step_share` is its share of that layout's step on the size's real model.
`trl_fixed_step_s` is TRL's step on the same null model at its best thread count: what any framework that
generates with HF and scores with math_verify pays per step at this batch, so `yatt_fixed_step_s` minus it is
YATT's own overhead (processes, Ray calls, weight push). `ratio_yatt_over_trl` is YATT's best layout (async
included) over TRL's best thread count, `sync_ratio_yatt_over_trl` YATT's best synchronous layout over the
same. `overlap_bound_over_trl` = 2 x TRL's one-thread tokens/s / TRL's best: about the most a layout that
does TRL's work per token, one role per core on two cores, can reach over TRL, since TRL already uses the
second core with its second thread (`trl_tokens_per_s_by_threads`). It is an estimate from one run of each
thread count, as noisy as they are.
CPU time, measured, beside the estimate: over each run's timed steps the machine's busy CPU seconds (every
core; on an idle machine, the run's own processes) are read from /proc at the end of the last warm-up step
and of the last step (YATT: stamped by controller 0 as each step ends; TRL: its step callbacks), with each
process's share. `yatt_tokens_per_cpu_s_by_layout` and `trl_tokens_per_cpu_s_by_threads` are completion tokens
per busy CPU second; `cpu_bound_over_trl` = cores x YATT's best tokens per CPU second / TRL's best tokens/s:
the most any schedule of YATT's CPU work as it is can reach over TRL on this machine (every core busy all
the time). `yatt_machine_busy` is the share of the cores the best layout kept busy; `*_steal_s_per_step` the
CPU time the hypervisor gave to other machines meanwhile (a noisy neighbour shows there).

Differences that cannot be removed: YATT spreads the step over processes (learner, rollout engine with a KV
cache and reward worker per device, weights pushed to the engine after each update; the reward worker scores
chunks while later ones generate); TRL runs one process and generates with `model.generate` on the training
model. YATT records sampling logprobs; the loss aggregation (YATT's preset default vs TRL's "dapo" token mean)
and learning-rate schedules differ, which does not change the amount of compute. Sampling differs in RNG
streams, so response lengths differ somewhat: tokens/s normalises for that. The machine is shared with other
work, so figures are noisy: compare the ratio within one run, not across runs; the load average at start and
end is in the JSON line. More processes get more of a loaded machine's CPU time than one, which favours YATT
on a busy machine; on an idle one the two cores are what YATT's layouts use and TRL's second thread does not.

    python benchmarks/bench_e2e.py --quick

The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

FORMAT_PATTERN = r"^\s*-?\d+"
KL_COEF, LR = 1e-3, 2e-3


# the two model sizes: today's tiny preset model, and a small one where generation dominates
SIZES = {
    "tiny": {},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64},
    # ~no compute (one layer of width 8): its step time is YATT's fixed per-step cost at the same batch
    "null": {"hidden_size": 8, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 8},
}


class Layout(NamedTuple):
    """A YATT layout: parallel controllers, logical devices, placement mode, bounded staleness."""

    controllers: int
    devices: int
    mode: str = "colocated"
    max_staleness: int = 0


# colocated layouts run each controller's learner rank, engine and reward worker on its own device; the async
# one puts the learner on device 0 and the rollout engine with the rule reward beside it on device 1, and
# trains on batches generated up to one policy version earlier (generation overlaps the update)
LAYOUTS = {
    "2c2d": Layout(2, 2),
    "1c1d": Layout(1, 1),
    "async1c2d": Layout(1, 2, "disaggregated", 1),
}
FINAL_STEPS = 3  # a run's final reward: the mean reward of its last steps


def build_policy(root: Path, num_rows: int, size: str) -> str:
    """The shared model directory of `size`, built once (tokenizer trained on the task)."""
    from yatt_apps.config import ModelSpec
    from yatt_apps.io.data import arithmetic_task
    from yatt_apps.io.models import prepare_model, tokenizer_corpus

    corpus = tokenizer_corpus(arithmetic_task(num_rows, seed=0))
    return str(prepare_model(ModelSpec(**SIZES[size]), root / f"policy-{size}", corpus))


def throughput(tokens: list[float], step_s: list[float]) -> dict:
    """Tokens per second of the timed steps: the median of the per-step figures, and the overall one."""
    return {
        "tokens": sum(tokens),
        "seconds": sum(step_s),
        "step_s": step_s,
        "tokens_per_s": statistics.median(n / s for n, s in zip(tokens, step_s, strict=True)),
        "tokens_per_s_overall": sum(tokens) / sum(step_s),
    }


# ---- CPU time ------------------------------------------------------------------------------------------


def cpu_reading() -> dict:
    """The machine's busy CPU seconds so far (every core: user, nice, system, irq, softirq; not idle, iowait
    or steal), the seconds the hypervisor gave to others (steal), and each process's own CPU seconds."""
    import psutil

    t = psutil.cpu_times()
    procs = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None:
            procs[proc.pid] = (proc.info["name"] or "?", times.user + times.system)
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return {"wall": time.perf_counter(), "busy": busy, "steal": getattr(t, "steal", 0.0), "procs": procs}


def cpu_per_step(start: dict, end: dict, steps: int) -> dict:
    """CPU seconds per step between two readings `steps` steps apart: the machine's (all its processes,
    so an idle machine's is the run's own), the steal, and the processes that used the most (name[pid])."""
    per_proc = {
        f"{name}[{pid}]": (cpu - start["procs"].get(pid, (name, 0.0))[1]) / steps
        for pid, (name, cpu) in end["procs"].items()
    }
    top = dict(sorted(per_proc.items(), key=lambda kv: -kv[1])[:6])
    return {
        "cpu_s_per_step": (end["busy"] - start["busy"]) / steps,
        "steal_s_per_step": (end["steal"] - start["steal"]) / steps,
        "wall_s_per_step": (end["wall"] - start["wall"]) / steps,
        "top_processes": {k: round(v, 4) for k, v in top.items()},
    }


class StampedSteps:
    """A job's step function that appends `step unix_time` to `path` as each of controller 0's steps ends: the
    bounds of the timed steps' CPU window. (The driver's metrics.jsonl cannot give them: reports reach it
    with the heartbeats, several steps at once.)"""

    def __init__(self, step_fn, path: Path) -> None:
        self.step_fn, self.path = step_fn, path

    def __call__(self, ctx, batch):
        out = self.step_fn(ctx, batch)
        if ctx.rank == 0:
            with open(self.path, "a") as f:
                f.write(f"{ctx.step} {time.time()}\n")
        return out


def stamped(job, path: Path):
    """`job` whose step function is wrapped in `StampedSteps` (pickled by value: the controllers' processes
    do not import this file)."""
    import dataclasses

    import ray.cloudpickle

    if __name__ != "__main__":
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def step(*args, **kwargs):
        return StampedSteps(job.step(*args, **kwargs), path)

    return dataclasses.replace(job, step=step)


class StampWatch:
    """Reads the CPU clocks when the lines of `path` (`StampedSteps`: one a step) reach `first` and then
    `last`, from a thread polling the file every 10 ms."""

    def __init__(self, path: Path, first: int, last: int) -> None:
        import threading

        self.path, self.marks, self.readings = path, (first, last), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01) and len(self.readings) < 2:
            try:
                lines = self.path.read_bytes().count(b"\n")
            except FileNotFoundError:
                continue
            for mark in self.marks:
                if lines >= mark and mark not in self.readings:
                    self.readings[mark] = cpu_reading()

    def result(self) -> dict | None:
        self._stop.set()
        self._thread.join()
        first, last = self.marks
        if first not in self.readings or last not in self.readings:
            return None
        return cpu_per_step(self.readings[first], self.readings[last], last - first)


# ---- YATT ------------------------------------------------------------------------------------------------


def yatt_config(policy_dir: str, args: argparse.Namespace, num_steps: int, layout: str):
    """`tiny_cpu` with the shared model, no judge (rule rewards only), the benchmark's batch and lengths, and
    every setting that changes the amount of work pinned to TRL's (one optimizer step per batch, whole batch
    per micro-batch, KL loss 1e-3), whatever the preset says. `layout` sets the controllers and devices."""
    import msgspec
    from yatt_apps.config import RunConfig, tiny_cpu
    from yatt_apps.overlay import build_config

    base = tiny_cpu()
    rules = [spec for spec in base.rewards if spec.kind != "genrm"]
    assert [s.kind for s in rules] == ["math_verify", "regex"]
    assert rules[1].options["pattern"] == FORMAT_PATTERN
    base = msgspec.structs.replace(base, judge=None, rewards=rules)
    lay = LAYOUTS[layout]
    devices = lay.devices
    per_rank = args.prompts * args.group_size // lay.controllers
    sets = [
        f"model.path={policy_dir}",
        "model.warm_start=none",
        f"controller.num_controllers={lay.controllers}",
        f"placement.cluster.devices_per_node={devices}",
        f"placement.mode={lay.mode}",
        f"algo.max_staleness={lay.max_staleness}",
        # a logical CPU device is an equal share of the machine's cores: its roles' torch threads
        f"placement.cpus_per_device={max(1, (os.cpu_count() or 1) // devices)}",
        f"run.num_steps={num_steps}",
        f"run.prompts_per_step={args.prompts}",
        f"data.num_train_rows={args.num_rows}",
        "run.eval_every=0",
        "run.progress=false",
        f"sampling.n={args.group_size}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        "sampling.temperature=1.0",
        "sampling.top_p=1.0",
        "sampling.top_k=0",
        f"optim.micro_batch_size={per_rank}",
        "optim.mini_batch_size=0",
        "learner.max_tokens_per_micro_batch=0",
        f"optim.lr={LR}",
        "optim.num_warmup_steps=0",
        "optim.clip_grad_norm=1.0",
        f"algo.kl_loss_coef={KL_COEF}",
        "algo.num_updates_per_batch=1",
        "controller.checkpoint_every=0",
        "controller.count_driver_bytes=true",  # the summary reports the driver's bytes
        # a CPU has no device memory to hand over: the engines keep their weights between steps (level 2
        # would discard them and the next push restore them)
        "placement.sleep_level=0",
    ]
    if lay.mode == "disaggregated":
        sets.append("placement.rollout_replicas=1")
    return build_config(RunConfig, base, None, sets)


def run_yatt(policy_dir: str, root: Path, args: argparse.Namespace, layout: str) -> dict:
    from yatt_apps.jobs.grpo import JOB
    from yatt_apps.runtime.launch import run_job

    cfg = yatt_config(policy_dir, args, args.warmup + args.steps, layout)
    started, run_dir = (
        time.perf_counter(),
        root / f"yatt-run-{layout}-{Path(policy_dir).name}-L{args.max_new_tokens}",
    )
    # the timed steps' CPU: from the end of the last warm-up step to the end of the last step
    stamps = root / f"{run_dir.name}.steps"
    watch = StampWatch(stamps, max(args.warmup, 1), args.warmup + args.steps)
    summary = run_job(cfg, run_dir, stamped(JOB, stamps))
    cpu = watch.result()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if row["step"] >= args.warmup]
    assert len(timed) == args.steps, f"YATT logged {len(rows)} steps, expected {args.warmup + args.steps}"
    phases = sorted({k for row in timed for k in row if k.startswith("time/") and k != "time/step"})
    tokens = [row["rollout/response_tokens"] for row in timed]
    return {
        **throughput(tokens, [row["time/step"] for row in timed]),
        "layout": layout,
        "phases_s": {
            k.removeprefix("time/"): statistics.median(row.get(k, 0.0) for row in timed) for k in phases
        },
        "reward_mean": [row["reward/mean"] for row in rows],
        "final_reward": statistics.fmean(row["reward/mean"] for row in rows[-FINAL_STEPS:]),
        "driver_bytes": summary["driver_bytes"],
        "wall_s": time.perf_counter() - started,
        "cpu": cpu,
        "tokens_per_cpu_s": _tokens_per_cpu_s(rows, cpu, max(args.warmup, 1)),
    }


def _tokens_per_cpu_s(rows: list[dict], cpu: dict | None, first: int) -> float | None:
    """Completion tokens per busy CPU second over the steps the CPU readings span (after line `first`)."""
    if cpu is None:
        return None
    tokens = [row["rollout/response_tokens"] for row in rows[first:]]
    return statistics.fmean(tokens) / cpu["cpu_s_per_step"]


# ---- TRL -------------------------------------------------------------------------------------------------


def _requests(completions, answer):
    from yatt_multimodal.types import RewardRequest

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    pairs = enumerate(zip(texts, answer, strict=True))
    return [RewardRequest(request_id=str(i), prompt="", response=t, reference=a) for i, (t, a) in pairs]


def math_verify_reward(prompts, completions, answer, **_) -> list[float]:
    from yatt_multimodal.rules import math_reward

    return [math_reward(r) for r in _requests(completions, answer)]


def format_reward(prompts, completions, answer, **_) -> list[float]:
    from yatt_multimodal.rules import regex_reward

    return [regex_reward(r, pattern=FORMAT_PATTERN, mode="search") for r in _requests(completions, answer)]


def _step_timer(batch_completions: int, warmup: int):
    """A TrainerCallback recording each optimizer step's wall time and completion tokens, and the CPU
    readings at the start of the first timed step and the end of each step after it (`cpu`: the last)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step_s, self.tokens, self.rewards, self._start = [], [], [], 0.0
            self.cpu: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if len(self.step_s) == warmup:
                self.cpu = [cpu_reading()]
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._start)
            if len(self.step_s) > warmup:
                self.cpu[1:] = [cpu_reading()]

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.tokens.append(logs["completions/mean_length"] * batch_completions)
                self.rewards.append(logs["reward"])

    return StepTimer()


def run_trl(policy_dir: str, root: Path, args: argparse.Namespace, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from yatt_apps.io.data import arithmetic_task

    rows = arithmetic_task(args.num_rows, seed=0)
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r.prompt}], "answer": r.answer} for r in rows]
    )
    batch = args.prompts * args.group_size
    config = GRPOConfig(
        output_dir=str(root / f"trl-run-{threads}-{args.max_new_tokens}"),
        use_cpu=True,
        use_vllm=False,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=KL_COEF,
        num_iterations=1,
        learning_rate=LR,
        max_grad_norm=1.0,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
        reward_weights=[1.0, 0.5],
    )
    timer = _step_timer(batch, args.warmup)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    rewards = [math_verify_reward, format_reward]
    trainer = GRPOTrainer(
        model=policy_dir, reward_funcs=rewards, args=config, train_dataset=data, callbacks=[timer]
    )
    trainer.train()
    assert len(timer.step_s) == len(timer.tokens) == args.warmup + args.steps, (timer.step_s, timer.tokens)
    timed = slice(args.warmup, None)
    cpu = cpu_per_step(timer.cpu[0], timer.cpu[1], args.steps)
    return {
        **throughput(timer.tokens[timed], timer.step_s[timed]),
        "cpu": cpu,
        "tokens_per_cpu_s": statistics.fmean(timer.tokens[timed]) / cpu["cpu_s_per_step"],
        "torch_threads": threads,
        "final_reward": statistics.fmean(timer.rewards[-FINAL_STEPS:]),
        "wall_s": time.perf_counter() - started,
    }


# ---- the run ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 timed steps per run; 15 min on a 2-core machine at load 20 (TRL at 2 threads is most of it)",
    )
    parser.add_argument("--sizes", default="tiny,small", help="model sizes, comma separated (tiny, small)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="YATT layouts, comma separated")
    parser.add_argument("--threads", default="", help="TRL torch thread counts (default: 1 and one per core)")
    parser.add_argument("--only", choices=["yatt", "trl"], help="run one side only (profiling)")
    parser.add_argument("--prompts", type=int, help="prompts per step (P)")
    parser.add_argument("--group-size", type=int, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, help="response length cap (L; small: 64)")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--steps", type=int, help="timed steps")
    parser.add_argument("--num-rows", type=int, default=256, help="rows of the arithmetic task")
    args = parser.parse_args(argv)
    if args.quick:  # two warm-up steps, as the full mode: a side's first steps pay one-time costs (YATT: each
        # engine's and rule worker's first batch, new padded lengths; TRL: its first generate and reward call)
        defaults = dict(prompts=16, group_size=4, max_new_tokens=16, warmup=2, steps=3)
    else:
        defaults = dict(prompts=32, group_size=8, max_new_tokens=32, warmup=2, steps=8)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sizes, args.layouts = args.sizes.split(","), args.layouts.split(",")
    threads = args.threads or f"1,{os.cpu_count() or 1}"
    args.threads = sorted({int(n) for n in threads.split(",")})
    sizes = {k: v for k, v in SIZES.items() if k != "null"}  # the null size is run for every size
    for name, valid, given in (("size", sizes, args.sizes), ("layout", LAYOUTS, args.layouts)):
        if unknown := [g for g in given if g not in valid]:
            raise SystemExit(f"unknown --{name}s {unknown}: valid are {sorted(valid)}")
    if any(args.prompts % LAYOUTS[layout].controllers for layout in args.layouts):
        raise SystemExit("--prompts must be a multiple of every layout's controller count")
    return args


def size_args(args: argparse.Namespace, size: str) -> argparse.Namespace:
    """The small size generates 64 new tokens unless --max-new-tokens says otherwise."""
    out = argparse.Namespace(**vars(args))
    if size == "small" and "--max-new-tokens" not in sys.argv:
        out.max_new_tokens = 64
    return out


def start_ray():
    """One local Ray session for every YATT run (two logical devices, the most any layout uses)."""
    from yatt_apps.runtime import local_ray

    return local_ray.start(num_cpus=8, num_gpus=max(lay.devices for lay in LAYOUTS.values()))


def bench_size(root: Path, args: argparse.Namespace, size: str) -> dict:
    """TRL at each thread count, YATT in each layout, on the model of `size`; the best of each side counts."""
    policy_dir = build_policy(root, args.num_rows, size)
    trls = [] if args.only == "yatt" else [run_trl(policy_dir, root, args, n) for n in args.threads]
    yatts = [] if args.only == "trl" else [run_yatt(policy_dir, root, args, lay) for lay in args.layouts]
    if trls and yatts:  # TRL's best thread count once more after YATT: a load swing during one side's turn
        best = max(trls, key=lambda res: res["tokens_per_s"])["torch_threads"]  # counts for neither side
        trls.append(run_trl(policy_dir, root, args, best) | {"repeat": True})
    print(
        f"[{size}] P={args.prompts} prompts x G={args.group_size}, L<={args.max_new_tokens} new tokens, "
        f"{args.steps} timed steps after {args.warmup} warm-up"
    )
    runs = [(f"yatt/{r['layout']}", r) for r in yatts]
    runs += [(f"trl/{r['torch_threads']}t" + ("/again" if r.get("repeat") else ""), r) for r in trls]
    for name, res in runs:
        steps, tps = ", ".join(f"{s:.2f}" for s in res["step_s"]), res["tokens_per_s"]
        cpu = res["cpu"] or {}
        print(
            f"  {name:10} {tps:9.1f} tokens/s median  ({res['tokens']:.0f} tokens in {res['seconds']:.2f} s; "
            f"steps {steps}; wall {res['wall_s']:.1f} s; CPU {cpu.get('cpu_s_per_step', 0):.3f} s a step)"
        )
    out = {"size": size, "max_new_tokens": args.max_new_tokens}
    if trls:
        trl = max(trls, key=lambda res: res["tokens_per_s"])
        out |= {
            "trl_tokens_per_s": round(trl["tokens_per_s"], 2),
            "trl_step_s_median": round(statistics.median(trl["step_s"]), 4),
            "trl_torch_threads": trl["torch_threads"],
            # "1_again": the best thread count's run after YATT's
            "trl_tokens_per_s_by_threads": {_trl_key(r): round(r["tokens_per_s"], 2) for r in trls},
        }
    if yatts:
        yatt = max(yatts, key=lambda res: res["tokens_per_s"])
        print(f"  yatt/{yatt['layout']} phases (median s): {json.dumps(_rounded(yatt['phases_s'], 3))}")
        out |= {
            "yatt_tokens_per_s": round(yatt["tokens_per_s"], 2),
            "yatt_step_s_median": round(statistics.median(yatt["step_s"]), 4),
            "yatt_layout": yatt["layout"],
            "yatt_tokens_per_s_by_layout": {r["layout"]: round(r["tokens_per_s"], 2) for r in yatts},
            "yatt_phases_s": _rounded(yatt["phases_s"], 4),
            "yatt_driver_bytes": yatt["driver_bytes"],
        }
    syncs = [r for r in yatts if not LAYOUTS[r["layout"]].max_staleness]
    asyncs = [r for r in yatts if LAYOUTS[r["layout"]].max_staleness]
    if syncs:  # the fixed per-step cost: the best synchronous layout on the null model, same batch
        sync = max(syncs, key=lambda res: res["tokens_per_s"])
        null_dir = build_policy(root, args.num_rows, "null")
        null = run_yatt(null_dir, root, args, sync["layout"])
        fixed = statistics.median(null["step_s"])
        print(f"  yatt/{sync['layout']} on the null model: step {fixed:.3f} s (YATT's fixed per-step cost)")
        out |= {
            "sync_final_reward": round(sync["final_reward"], 4),
            "yatt_fixed_step_s": round(fixed, 4),
            "yatt_fixed_step_share": round(fixed / statistics.median(sync["step_s"]), 3),
        }
        if trls:  # TRL on the same null model: the per-step cost no framework at this batch avoids
            null_trl = run_trl(null_dir, root, args, trl["torch_threads"])
            out["trl_fixed_step_s"] = round(statistics.median(null_trl["step_s"]), 4)
            print(f"  trl/{trl['torch_threads']}t on the null model: step {out['trl_fixed_step_s']:.3f} s")
    if asyncs:
        out["async_final_reward"] = round(max(asyncs, key=lambda r: r["tokens_per_s"])["final_reward"], 4)
    if trls:
        out["trl_final_reward"] = round(trl["final_reward"], 4)
    if trls and yatts:
        out["ratio_yatt_over_trl"] = round(yatt["tokens_per_s"] / trl["tokens_per_s"], 3)
        out["ratio_overall"] = round(yatt["tokens_per_s_overall"] / trl["tokens_per_s_overall"], 3)
    one_thread = [r["tokens_per_s"] for r in trls if r["torch_threads"] == 1]
    if one_thread:
        out["overlap_bound_over_trl"] = round(2 * max(one_thread) / trl["tokens_per_s"], 3)
    if trls and syncs:
        out["sync_ratio_yatt_over_trl"] = round(sync["tokens_per_s"] / trl["tokens_per_s"], 3)
    out |= cpu_keys(trls, yatts, trl if trls else None, yatt if yatts else None)
    return out


def cpu_keys(trls: list[dict], yatts: list[dict], trl: dict | None, yatt: dict | None) -> dict:
    """What the machine's CPU time says: each run's completion tokens per busy CPU second, and the most a
    layout could reach over TRL with its CPU work as it is (`cpu_bound_over_trl`: every core busy all the
    time, so tokens/s = cores x tokens per CPU second; no schedule of the same work does better). The best
    runs' CPU seconds a step, how busy they kept the machine, the steal (CPU time the hypervisor gave to
    others while they ran) and their processes that used the most."""
    cores = os.cpu_count() or 1
    out: dict = {}
    if trls:
        out["trl_tokens_per_cpu_s_by_threads"] = {
            _trl_key(r): round(r["tokens_per_cpu_s"], 1) for r in trls if r["tokens_per_cpu_s"]
        }
    if yatts:
        out["yatt_tokens_per_cpu_s_by_layout"] = {
            r["layout"]: round(r["tokens_per_cpu_s"], 1) for r in yatts if r["tokens_per_cpu_s"]
        }
    for side, best in (("trl", trl), ("yatt", yatt)):
        cpu = best and best["cpu"]
        if cpu:
            out[f"{side}_cpu_s_per_step"] = round(cpu["cpu_s_per_step"], 4)
            out[f"{side}_machine_busy"] = round(cpu["cpu_s_per_step"] / (cores * cpu["wall_s_per_step"]), 3)
            out[f"{side}_steal_s_per_step"] = round(cpu["steal_s_per_step"], 4)
            out[f"{side}_cpu_top_processes"] = cpu["top_processes"]
    bounds = [r["tokens_per_cpu_s"] for r in yatts if r["tokens_per_cpu_s"]]
    if trl and bounds:
        out["cpu_bound_over_trl"] = round(cores * max(bounds) / trl["tokens_per_s"], 3)
    return out


def _trl_key(res: dict) -> str:
    return f"{res['torch_threads']}" + ("_again" if res.get("repeat") else "")


def _rounded(values: dict[str, float], digits: int) -> dict[str, float]:
    return {k: round(v, digits) for k, v in values.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    from yatt_apps.runtime.launch import ENV

    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    result = {
        "benchmark": "e2e_grpo_step",
        "quick": args.quick,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
    }
    session = start_ray() if args.only != "trl" else None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
            for size in args.sizes:
                # the tiny size's figures are the top-level keys, every other size's sit under its name
                res = bench_size(Path(tmp), size_args(args, size), size)
                result |= res if size == "tiny" else {size: res}
    finally:
        if session is not None:
            session.shutdown()
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
