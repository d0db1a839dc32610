"""Running a job from its config: data and models checked first, a placement plan realized on Ray, the
controllers launched through yatt_controller, and every step's metrics logged to the run directory.

The driver only plans, launches and watches: rows are read inside each controller (a dataset factory), and
only step reports (small numbers) come back.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.config import ModelSpec, RunConfig
from yatt_apps.data import PromptRow, arithmetic_task, check_prompt_lengths, load_rows
from yatt_apps.models import load_tokenizer, prepare_model, tokenizer_corpus
from yatt_apps.rundir import RunDir

# Set before Ray is imported. RAY_ENABLE_UV_RUN_RUNTIME_ENV=0: under `uv run`, Ray would otherwise package the
# working directory (the whole checkout, .venv included) as every worker's runtime env and start them in a copy.
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip

StepFactory = Callable[[RunConfig, str, Callable[[], list[PromptRow]] | None], Callable]


def train_rows(cfg: RunConfig) -> list[PromptRow]:
    if cfg.app == "sft":  # HOOK(hsft, issue 14): until the generic job declaration replaces it
        from yatt_apps.sft import train_rows as sft_rows

        return sft_rows(cfg)
    data = cfg.data
    if not data.train:
        return arithmetic_task(data.num_train_rows, seed=cfg.run.seed)
    return load_rows(
        data.train, prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key
    )


def val_rows(cfg: RunConfig) -> list[PromptRow]:
    data = cfg.data
    if not data.val:
        return arithmetic_task(data.num_val_rows, seed=cfg.run.seed + 10_000) if not data.train else []
    return load_rows(
        data.val, prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key
    )


def _num_params(spec: ModelSpec) -> float:
    """For planning: the spec's count, else the transformer estimate 12 L h^2 + 2 V h."""
    return (
        spec.num_params or 12 * spec.num_layers * spec.hidden_size**2 + 2 * spec.vocab_size * spec.hidden_size
    )


def placement_plan(cfg: RunConfig):
    """Roles from the config: the trained policy (actor), rollout, and the reward service (genrm with a judge)."""
    from yatt_placement.planner import plan
    from yatt_placement.types import RoleSpec

    if cfg.app == "sft":  # HOOK(hsft, issue 14): until the generic job declaration replaces it
        from yatt_apps.sft import roles as sft_roles

        return plan(cfg.placement.cluster, sft_roles(cfg), cfg.placement.mode)
    policy = _num_params(cfg.model)
    roles = [
        RoleSpec(role="actor", num_params=policy, trainable=True, tensor_parallel=cfg.model.tensor_parallel),
        RoleSpec(role="rollout", num_params=policy, tensor_parallel=cfg.model.tensor_parallel),
    ]
    if cfg.app == "ppo":  # the value model: the policy's backbone with a one-label head, trained beside it
        roles.append(
            RoleSpec(
                role="critic", num_params=policy, trainable=True, tensor_parallel=cfg.model.tensor_parallel
            )
        )
    if cfg.judge is not None:
        roles.append(
            RoleSpec(
                role="genrm", num_params=_num_params(cfg.judge), tensor_parallel=cfg.judge.tensor_parallel
            )
        )
    else:
        roles.append(RoleSpec(role="reward", num_params=1e6))
    return plan(cfg.placement.cluster, roles, cfg.placement.mode)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _build(pool, *, cfg: RunConfig, policy_dir: str, judge_dir: str):
    from yatt_controller.runner import Services
    from yatt_controller.sync import WeightSync
    from yatt_controller.worker_group import WorkerGroup

    from yatt_apps.workers import PolicyWorker, RewardWorker, RolloutWorker

    if cfg.app == "sft":  # HOOK(hsft, issue 14): until the generic job declaration replaces it
        from yatt_apps.sft import build as sft_build

        return sft_build(pool, cfg=cfg, policy_dir=policy_dir, judge_dir=judge_dir)
    actor = WorkerGroup.create(
        pool, "actor", PolicyWorker, args=(cfg, policy_dir, _free_port()), pass_worker_info=True
    )
    rollout = WorkerGroup.create(pool, "rollout", RolloutWorker, args=(cfg, policy_dir))
    if cfg.app == "capo":  # the reward service also hosts the step critic on the judge model
        from yatt_apps.capo import CritiqueWorker

        reward = WorkerGroup.create(pool, "genrm", CritiqueWorker, args=(cfg, judge_dir, policy_dir))
    else:
        reward = WorkerGroup.create(
            pool, "genrm" if judge_dir else "reward", RewardWorker, args=(cfg, judge_dir)
        )
    groups = {"actor": actor, "rollout": rollout, "reward": reward}
    if cfg.app == "ppo":
        from yatt_apps.ppo import CriticWorker

        groups["critic"] = WorkerGroup.create(
            pool, "critic", CriticWorker, args=(cfg, policy_dir, _free_port()), pass_worker_info=True
        )
    mode = "colocated" if cfg.placement.mode == "colocated" else "broadcast"
    sync = WeightSync(actor, [rollout], mode=mode)
    stateful = ("critic",) if "critic" in groups else ()  # its weights and optimizer go into every checkpoint
    return Services(groups=groups, learner="actor", weight_sync=sync, checkpointed=stateful)


class StepLogger:
    """The driver's `on_step`: one line of metrics per step into the run directory, and the progress bar."""

    def __init__(self, run: RunDir, num_steps: int, start_step: int, progress: bool):
        self.run, self.last = run, {}
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=num_steps, initial=start_step, desc="yatt", unit="step", dynamic_ncols=True)

    def __call__(self, step: int, reports: list[Any]) -> None:
        lead = reports[0]
        timings = {f"time/{k}": v for k, v in lead.timings_s.items()}
        phases = sum(v for k, v in lead.timings_s.items() if k != "step")
        step_s = lead.timings_s.get("step", phases)
        metrics = {**lead.metrics, **timings, "time/idle": max(step_s - phases, 0.0)}
        metrics["throughput/tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / max(step_s, 1e-9)
        self.run.log(step, metrics)
        self.last = {"step": step, **metrics}
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics.get('reward/mean', 0.0):.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _init_ray(cfg: RunConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    devices = cfg.placement.cluster.num_devices
    ray.init(num_cpus=int(devices * cfg.placement.cpus_per_device) + 4, num_gpus=devices, include_dashboard=False,
             object_store_memory=512 * 2**20, log_to_driver=False)  # fmt: skip


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """The config with its data and model paths made absolute (workers may start in another directory)."""
    replace = msgspec.structs.replace

    def absolute(path: str) -> str:
        return str(Path(path).resolve()) if path else path

    data = replace(cfg.data, train=absolute(cfg.data.train), val=absolute(cfg.data.val))
    model = replace(cfg.model, path=absolute(cfg.model.path))
    judge = None if cfg.judge is None else replace(cfg.judge, path=absolute(cfg.judge.path))
    sft = replace(cfg.sft, train=absolute(cfg.sft.train))  # HOOK(hsft, issue 14)
    return replace(cfg, data=data, model=model, judge=judge, sft=sft)


def run_job(cfg: RunConfig, run_dir: str | Path, step_factory: StepFactory) -> dict[str, Any]:
    """Run (or resume, when `run_dir` holds checkpoints) `cfg` and return the last step's metrics."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    run = RunDir(Path(run_dir).resolve())  # absolute: workers do not share the driver's working directory
    cfg = absolute_paths(cfg)
    run.write_config(cfg)
    rows = train_rows(cfg)  # read once here to fail fast on bad data; controllers read their own shards
    judge_text = ["Verify the solution step by step. Is the answer correct? Yes No"]
    corpus = tokenizer_corpus(rows, judge_text)
    policy_dir = str(prepare_model(cfg.model, run.path / "models" / "policy", corpus))
    judge_dir = str(prepare_model(cfg.judge, run.path / "models" / "judge", corpus)) if cfg.judge else ""
    tok = load_tokenizer(policy_dir)
    from yatt_apps.grpo import render_prompt

    lengths = [len(render_prompt(tok, row, cfg.data.system_prompt)) for row in rows]
    check_prompt_lengths(
        rows, lengths, cfg.data.max_prompt_tokens, cfg.data.train or "embedded arithmetic task"
    )
    plan = placement_plan(cfg)
    del rows, tok

    import ray
    from yatt_controller import checkpoint
    from yatt_controller.runner import Job
    from yatt_controller.runner import run as run_controllers
    from yatt_placement.realize import realize, release

    _init_ray(cfg)
    realized = realize(plan, cpus_per_device=cfg.placement.cpus_per_device)
    found = checkpoint.latest(str(run.checkpoints))
    start = 0 if found is None else found[1].step + 1
    logger = StepLogger(run, cfg.run.num_steps, start, cfg.run.progress)
    if cfg.app == "sft":  # HOOK(hsft, issue 14): the SFT job writes RUN_DIR/final on its last step
        step_factory = functools.partial(step_factory, final_dir=str(run.path / "final"))
    job = Job(
        build=functools.partial(_build, cfg=cfg, policy_dir=policy_dir, judge_dir=judge_dir),
        step_fn=step_factory(cfg, policy_dir, functools.partial(val_rows, cfg)),
        dataset=functools.partial(train_rows, cfg), batch_size=cfg.run.prompts_per_step,
        num_steps=cfg.run.num_steps, checkpoint_dir=str(run.checkpoints), on_step=logger,
    )  # fmt: skip
    started = time.perf_counter()
    try:
        result = run_controllers(cfg.controller, job, realized)
    finally:
        logger.close()
        release(realized)
        ray.shutdown()
        plot = run.close()
    return {**logger.last, "restarts": result.restarts, "driver_bytes": result.driver_bytes,
            "seconds": time.perf_counter() - started, "run_dir": str(run.path), "plot": str(plot)}  # fmt: skip
