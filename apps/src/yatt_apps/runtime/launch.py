"""Running a job from its config: data and models checked first, a placement plan realized on Ray, the
controllers launched through yatt_controller, and every step's metrics logged to the run directory.

The driver only plans, launches and watches: rows are read inside each controller (a dataset factory), and
only step reports (small numbers) come back.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import msgspec

from yatt_apps.config import RunConfig
from yatt_apps.io.data import PromptRow, arithmetic_task, load_rows
from yatt_apps.io.models import load_tokenizer, prepare_model, tokenizer_corpus
from yatt_apps.io.row_sources import open_rows, stream_check
from yatt_apps.io.rundir import RunDir
from yatt_apps.runtime.job import JobDef
from yatt_apps.runtime.phases import SyncBytes, background_push, initial_push
from yatt_apps.runtime.progress import StepLogger, quiet_transformers
from yatt_apps.runtime.step_metrics import ValidationSet

if TYPE_CHECKING:
    from yatt_placement.types import PlacementPlan

# Set before Ray is imported. RAY_ENABLE_UV_RUN_RUNTIME_ENV=0: under `uv run`, Ray would otherwise package the
# working directory (the whole checkout, .venv included) as every worker's runtime env and start them in a copy.
ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def train_rows(cfg: RunConfig) -> Sequence[PromptRow]:
    """The training rows as a sequence read row by row (a controller loads only the rows of its shard)."""
    data = cfg.data
    if not data.train:
        return arithmetic_task(data.num_train_rows, seed=cfg.run.seed)
    return open_rows(
        data.train, prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key
    )


def val_rows(cfg: RunConfig) -> list[PromptRow]:
    data = cfg.data
    if not data.val:
        return arithmetic_task(data.num_val_rows, seed=cfg.run.seed + 10_000) if not data.train else []
    return load_rows(
        data.val, prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key
    )


def placement_plan(cfg: RunConfig, job: JobDef) -> PlacementPlan:
    """The job's roles placed on the configured cluster, sized from `placement.profile` when one is given.
    The one place (with `job.policy_roles`, which sizes the roles) where the apps read `placement.mode`:
    everything after asks the plan (`shares_device`, `sleeps`, `movable`, ...)."""
    from yatt_placement.planner import plan
    from yatt_placement.types import JobProfile

    profile = JobProfile(device_seconds=cfg.placement.profile) if cfg.placement.profile else None
    return plan(cfg.placement.cluster, job.roles(cfg), cfg.placement.mode, profile=profile)


def replan_hook(
    cfg: RunConfig, job: JobDef, plan: PlacementPlan, log_path: Path | None = None
) -> Callable[[int, dict[str, float], float], PlacementPlan | None] | None:
    """Dynamic placement: the driver's per-step hook. It turns the hosts' measured busy seconds (device-seconds
    per role over the reading's window, yatt_controller.replan) into `PhaseStats` (mean busy seconds per device
    of each movable role, and the step's wall seconds: how the re-planner verifies that a move paid) for
    `DynamicReplanner`, and returns the new plan it decides (applied by the runtime
    at the next weight-sync boundary), else None. A step without a usable reading of its own (`{}`) is not
    observed. With `log_path` (RUN_DIR/placement.jsonl), every step is appended as one JSON line: the step,
    each movable role's busy seconds per device and devices, whether it moved, and why (or why not): what a
    user reads to see why the devices did or did not move."""
    if not plan.movable:
        return None
    from yatt_placement.replanner import DynamicReplanner
    from yatt_placement.types import PhaseStats

    planner = DynamicReplanner(cfg.placement.cluster, job.roles(cfg), plan, cfg.placement.replan)

    def replan(step: int, busy: dict[str, float], step_s: float) -> PlacementPlan | None:
        devices = {key: planner.devices(key) for key in planner.movable()}
        per_device = {key: busy.get(key, 0.0) / n for key, n in devices.items()}
        new = None
        if busy:
            step_time = max(step_s, max(per_device.values(), default=0.0), 1e-6)
            stats = PhaseStats(step=step, step_time_s=step_time, busy_s=per_device, num_devices=devices)
            new = planner.observe(stats)
            reason = planner.last_reason
        else:
            reason = NO_READING
        if log_path is not None:
            record = {
                "step": step,
                "step_s": step_s,
                "busy_s_per_device": per_device if busy else {},
                "devices": devices,
                "moved": new is not None,
                "reason": reason,
            }
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return new

    return replan


NO_READING = (
    "no reading of its own: its busy seconds are in a neighbouring step's (reports reach the driver several at "
    "a time), or a posted move was landing (readings through the step that applied it are dropped)"
)


def check_async_placement(cfg: RunConfig, plan: PlacementPlan) -> None:
    """Async training (`algo.max_staleness > 0`) overlaps generation with training, which a plan whose roles
    time-share every device phase by phase (`plan.sleeps`: full colocation) cannot do."""
    if cfg.algo.max_staleness and plan.sleeps:
        raise ValueError(
            "algo.max_staleness > 0 needs placement.mode disaggregated (or partial/dynamic): in full colocation "
            "rollout and training time-share every device's process, so generation cannot overlap training"
        )


def with_async_correction(cfg: RunConfig) -> RunConfig:
    """Async training corrects for the behaviour policy (the rollout engine's logprobs) with token-level
    truncated importance sampling, cap `algo.rollout_is_threshold` (2 by default), unless a level is set."""
    if not cfg.algo.max_staleness or cfg.algo.rollout_is_level != "none":
        return cfg
    return msgspec.structs.replace(cfg, algo=msgspec.structs.replace(cfg.algo, rollout_is_level="token"))


def optimizer_updates_per_step(cfg: RunConfig, plan: PlacementPlan) -> int:
    """Optimizer steps one RL step makes on a learner rank: updates per batch x mini-batches per update. The
    step's samples split over the plan's actor replicas (data-parallel ranks)."""
    samples = cfg.run.prompts_per_step * cfg.sampling.n
    per_rank = samples // max(plan.num_replicas("actor") or cfg.controller.num_controllers, 1)
    mini = cfg.optim.mini_batch_size
    return cfg.algo.num_updates_per_batch * (-(-per_rank // mini) if mini else 1)


def with_schedule(cfg: RunConfig, plan: PlacementPlan) -> RunConfig:
    """The LR schedule spans the run's optimizer updates (run.schedule_steps or run.num_steps, x updates per
    step), whatever optim.num_training_steps said, so the learning rate reaches its floor at the last step."""
    total = (cfg.run.schedule_steps or cfg.run.num_steps) * optimizer_updates_per_step(cfg, plan)
    from yatt_algos.types import OptimConfig

    # every optimizer of the job's config (the policy's `optim`, PPO's `critic_optim`, ...)
    optims = {name: getattr(cfg, name) for name in cfg.__struct_fields__}
    changes = {
        name: msgspec.structs.replace(o, num_training_steps=max(total, o.num_warmup_steps + 1))
        for name, o in optims.items()
        if isinstance(o, OptimConfig)
    }
    return msgspec.structs.replace(cfg, **changes)


def _init_ray(cfg: RunConfig) -> Callable[[], None] | None:
    """Join the cluster at `ray.address` (or $RAY_ADDRESS) with its real resources, or start the embedded
    local Ray (loopback only, no dashboard, its processes reaped with the driver: `local_ray`) declaring the
    config's devices as logical GPUs. Returns what stops what this call started; None: Ray was already up
    (an embedding program's, or a test's shared session), and the job leaves it running."""
    import ray

    if ray.is_initialized():
        return None
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return ray.shutdown
    from yatt_apps.runtime import local_ray

    devices = cfg.placement.cluster.num_devices
    return local_ray.start(
        num_cpus=int(devices * cfg.placement.cpus_per_device) + 4, num_gpus=devices
    ).shutdown


def check_hardware(cfg: RunConfig, plan: PlacementPlan) -> None:
    """A plan of real models that needs more devices than this machine has, with no cluster to join, stops
    here with what it needs. Tiny models (no model.path) run on logical devices anywhere, as on CPU."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS") or not cfg.model.path:
        return
    import torch

    have = torch.cuda.device_count()
    if plan.num_devices > max(have, 1) and (have or plan.num_devices > (os.cpu_count() or 1)):
        cluster = cfg.placement.cluster
        raise RuntimeError(
            f"the placement plan ({plan.mode}) needs {plan.num_devices} devices ({cluster.num_nodes} nodes x "
            f"{cluster.devices_per_node}); this machine has {have} CUDA device(s). Run it on a GPU cluster: start "
            "Ray there and set ray.address (see README, Multi-node), or shrink placement.cluster"
        )


def tiny_corpus(cfg: RunConfig, dataset: Any = train_rows) -> list[str]:
    """The text a tiny model's tokenizer is trained on: the training rows and the judge's instruction."""
    judge_text = ["Verify the solution step by step. Is the answer correct? Yes No"]
    rows = dataset(cfg)
    return tokenizer_corpus((rows[i] for i in range(len(rows))), judge_text)


def prepare_models(cfg: RunConfig, run: RunDir | Path, dataset: Any = train_rows) -> tuple[str, str]:
    """The policy's and the judge's model directories; tiny ones are built under RUN_DIR/models with a
    tokenizer trained on the task's text (the only time the driver reads every row's text)."""
    root = run if isinstance(run, Path) else run.path
    tiny = not cfg.model.path or (cfg.judge is not None and not cfg.judge.path)
    corpus = tiny_corpus(cfg, dataset) if tiny else []
    policy_dir = str(prepare_model(cfg.model, root / "models" / "policy", corpus))
    judge = root / "models" / "judge"
    judge_dir = str(prepare_model(cfg.judge, judge, corpus, key="judge.path")) if cfg.judge else ""
    return policy_dir, judge_dir


def check_data(cfg: RunConfig, policy_dir: str | None, dataset: Any = train_rows) -> None:
    """Every training row validated and its prompt length checked, one row at a time, none held. Without a
    tokenizer (`policy_dir` None: a tiny one is not built yet) the rows are validated and lengths wait."""
    from yatt_apps.runtime.phases import render_prompt

    system, limit = cfg.data.system_prompt, cfg.data.max_prompt_tokens
    tok = None if policy_dir is None else load_tokenizer(policy_dir)

    def tokens(row: PromptRow) -> int:
        return 0 if tok is None else len(render_prompt(tok, row, system))

    for _ in stream_check(dataset(cfg), tokens, limit):
        pass


# what `run_job` does with a folder that already holds a run (`holds_run`): continue it (`yatt resume`, and a
# program calling run_job again), refuse (`yatt NAME --run-dir`), or delete its files first (`--overwrite`)
Existing = Literal["resume", "refuse", "overwrite"]
EXISTING: tuple[Existing, ...] = get_args(Existing)


def check_run_folder(path: Path, existing: Existing) -> None:
    """A new job never writes into another run's folder: refused, naming the two ways on."""
    from yatt_apps.io.rundir import holds_run

    if existing not in EXISTING:
        raise ValueError(f"existing={existing!r} is not one of {EXISTING}")
    from yatt_apps.runtime.progress import yatt_command

    if existing == "refuse" and holds_run(path):
        raise ValueError(
            f"{path} already holds a run: continue it with `{yatt_command()} resume {path}`, or add --overwrite to delete "
            "its records and checkpoints and start over there"
        )


def prepare_run(
    cfg: RunConfig, path: Path, job: JobDef, existing: Existing
) -> tuple[RunConfig, PlacementPlan, str, str]:
    """Every check, then the models: (cfg, plan, policy_dir, judge_dir). The checks that need no model (config,
    placement, hardware, every data row; prompt lengths too for a `model.path` tokenizer) run before the run
    folder is touched; a tiny model's lengths are checked once it is built. A folder this call created is
    removed again when a check fails; an existing run's records are not touched here."""
    created = not path.exists()
    try:
        if job.prepare is not None:  # may write into the folder (grpo-vlm's generated task)
            cfg = job.prepare(cfg, path)
        cfg = absolute_paths(cfg)
        plan = placement_plan(cfg, job)
        check_async_placement(cfg, plan)
        check_hardware(cfg, plan)
        rows = job.dataset or train_rows
        given = prepare_model(cfg.model, path, []) if cfg.model.path else None  # a user's model: only read
        check_data(cfg, None if given is None else str(given), rows)
        if existing == "overwrite":
            from yatt_apps.io.rundir import clear_run

            clear_run(path)
        policy_dir, judge_dir = prepare_models(cfg, path, rows)
        if given is None:
            check_data(cfg, policy_dir, rows)
    except BaseException:
        if created:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        raise
    return cfg, plan, policy_dir, judge_dir


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """The config with its data and model paths made absolute (workers may start in another directory)."""
    replace = msgspec.structs.replace

    def absolute(path: str) -> str:
        from yatt_apps.io.model_sources import is_hub_id

        return str(Path(path).resolve()) if path and not is_hub_id(path) else path

    data = replace(cfg.data, train=absolute(cfg.data.train), val=absolute(cfg.data.val))
    model = replace(cfg.model, path=absolute(cfg.model.path))
    judge = None if cfg.judge is None else replace(cfg.judge, path=absolute(cfg.judge.path))
    return replace(cfg, data=data, model=model, judge=judge)


def run_job(
    cfg: RunConfig, run_dir: str | Path, job: JobDef, *, existing: Existing = "resume"
) -> dict[str, Any]:
    """Run `cfg` and return the last step's metrics. A folder that already holds a run is continued from its
    newest checkpoint that verifies (`existing="resume"`), refused (`"refuse"`, a new job's), or cleared
    first (`"overwrite"`). Nothing in the folder changes before every check has passed."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    quiet_transformers()  # the driver builds and saves tiny models before the step logger exists
    path = Path(run_dir).resolve()  # absolute: workers do not share the driver's working directory
    check_run_folder(path, existing)
    if cfg.algo.max_staleness and not job.asynchronous:
        raise ValueError(f"algo.max_staleness > 0: the {cfg.app} job trains on-policy only (use yatt grpo)")
    if cfg.rollout.env:  # an unknown environment or an app without multi-turn support fails here
        from yatt_apps.runtime.agent import check_env

        check_env(cfg)
    if job.check is not None:
        job.check(cfg)
    started_at = time.perf_counter()
    from yatt_controller import checkpoint

    # checkpoints that exist but do not verify: refused here (NoValidCheckpoint), before anything is written;
    # the ones skipped are named by the runtime when its attempt resumes (once per attempt)
    resuming = existing == "resume"
    found = checkpoint.resumable(str(path / "checkpoints"), report=lambda _: None) if resuming else None
    cfg, plan, policy_dir, judge_dir = prepare_run(cfg, path, job, existing)
    # a resumed run's records are cut back to its checkpoint's step (-1: a fresh start keeps none)
    run = RunDir(path, resume_step=-1 if found is None else found[1].step)
    run.write_config(cfg)
    cfg = with_async_correction(with_schedule(cfg, plan))
    rows = job.dataset or train_rows

    from yatt_controller import warm
    from yatt_controller.runner import Job
    from yatt_controller.runner import run as run_controllers

    from yatt_apps.runtime.workers import learner_backend

    stop_ray = _init_ray(cfg)
    # hosts kept between jobs (YATT_KEEP_HOSTS) only in a Ray that outlives this job: one it started stops.
    # A Megatron job starts hosts of its own: in hosts an earlier job had used, its checkpoint's barrier once
    # waited forever (CI preview, after an FSDP2 job; not reproduced alone), and Megatron's hosts are never
    # kept after it (its parallel state is process-wide)
    megatron = learner_backend(cfg) == "megatron"
    if megatron:
        warm.drop()
    keep_hosts = warm.enabled() and stop_ray is None and not megatron
    realized = warm.realize(plan, cpus_per_device=cfg.placement.cpus_per_device)  # a warm group if it fits
    start = 0 if found is None else found[1].step + 1
    logger = StepLogger(run, cfg.run.num_steps, start, cfg.run.progress, started_at=started_at)
    runtime = Job(
        build=functools.partial(job.build, cfg=cfg, policy_dir=policy_dir, judge_dir=judge_dir, plan=plan),
        step_fn=SyncBytes(job.step(cfg, policy_dir, ValidationSet(functools.partial(val_rows, cfg)), plan)),
        dataset=functools.partial(rows, cfg),
        batch_size=cfg.run.prompts_per_step,
        num_steps=cfg.run.num_steps,
        checkpoint_dir=str(run.checkpoints),
        on_step=logger,
        # streamed like every step's push: no rank holds the whole model
        initial_push=functools.partial(initial_push, background=background_push(cfg)),
        **({"replan": hook} if (hook := replan_hook(cfg, job, plan, path / "placement.jsonl")) else {}),
    )
    failed = True
    try:
        result = run_controllers(cfg.controller, runtime, realized, keep_hosts=keep_hosts)
        failed = False
    finally:
        closers: list[Callable[[], Any]] = [
            logger.close,
            functools.partial(warm.release, realized),
            stop_ray or (lambda: None),  # None: Ray was up already and stays
            run.close,
        ]
        plot = close_all(closers, run, quiet=failed)
    final = job.export(run, cfg) if job.export is not None else export_final(run, cfg)
    return {
        **logger.last,
        "restarts": result.restarts,
        "failures": list(result.failures),  # why each restart happened
        "driver_bytes": result.driver_bytes,
        "moves": len(result.moves),
        # dead service replicas replaced without a restart, over every attempt of the run
        "faults/replicas_replaced": float(result.replicas_replaced),
        "seconds": time.perf_counter() - started_at,
        "run_dir": str(run.path),
        "plot": str(plot),
        "final": str(final) if final else "",
    }


def close_all(closers: list[Callable[[], Any]], run: RunDir, *, quiet: bool) -> Any:
    """Run every closer in order, then remove checkpoint staging folders (nothing writes one any more). After
    a failed run (`quiet`) a closer's own error (the same full disk again) is dropped, so the run's first
    error is the one reported; after a good run the first closer error is raised once all have run. Returns
    the last closer's result (`RunDir.close`'s plot)."""
    import shutil

    first: BaseException | None = None
    result = None
    for closer in closers:
        try:
            result = closer()
        except Exception as err:
            first = first or err
    for staging in run.checkpoints.glob(".staging-*") if run.checkpoints.is_dir() else []:
        shutil.rmtree(staging, ignore_errors=True)
    if first is not None and not quiet:
        raise first
    return result


def export_final(run: RunDir, cfg: RunConfig) -> Path | None:
    """RUN_DIR/final: the trained policy as an HF folder, from the checkpoint of the run's last step (the
    runtime always checkpoints it when checkpointing is on); None when there is no such checkpoint."""
    from yatt_controller import checkpoint

    from yatt_apps.io.export import find_checkpoint, load_policy, policy_dir, run_config, save_hf

    found = checkpoint.latest(str(run.checkpoints))
    if found is None or found[1].step != cfg.run.num_steps - 1:
        return None
    if cfg.learner.backend == "megatron":  # its blobs hold Megatron's names: HF conversion not wired here
        print(f"{run.path}: final/ not written: export of Megatron learner checkpoints is not supported yet")
        return None
    ckpt, _ = find_checkpoint(run.path, found[1].step)
    model = load_policy(run.path, ckpt)
    return save_hf(model, policy_dir(run.path, run_config(run.path)), run.path / "final")  # atomic replace
