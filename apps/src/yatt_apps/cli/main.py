"""The `yatt` command. Each subcommand is a thin parser over one app module, imported only when chosen,
so `yatt --help` stays fast.

Job commands (`grpo`, ...) take a preset (`--preset`, default `tiny_cpu`), a YAML overlay (`--config`) and
`--set key=value` overrides; `yatt resume RUN_DIR` continues a run from its newest complete checkpoint;
`yatt config` prints the resolved config with a doc per key; `yatt export` writes a checkpoint's policy as an
HF folder. Exit codes: 0 done, 1 the run failed, 2 bad input (config, data, arguments), 130 interrupted
(Ctrl-C: the run stops, Ray is shut down, and the command prints how to resume).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import statistics
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yatt_apps.config import RunConfig
    from yatt_apps.runtime.job import JobDef
    from yatt_apps.runtime.launch import Existing

# plain subcommand -> (help, "module:function" taking the parsed args and returning an exit code, kind); the
# job commands (`grpo`, `ppo`, ...) come from the job registry (`yatt_apps.jobs`), one per JobDef
COMMANDS: dict[str, tuple[str, str, str]] = {
    "doctor": (
        "check the installation: packages, backends, devices, and a wire/codec/model round trip",
        "yatt_apps.cli.doctor:main",
        "plain",
    ),
    "run": (
        "run a job defined in your own Python file (JOB = JobDef(...)): yatt run path/to/job.py [--set ...]",
        "yatt_apps.cli.main:file_main",
        "file",
    ),
    "config": (
        "print the full resolved config as YAML, one doc comment per key (--job, --preset, --config, --set)",
        "yatt_apps.cli.main:config_main",
        "job",
    ),
    "plan": (
        "print the placement plan of a config as a table (or --json)",
        "yatt_apps.cli.main:plan_main",
        "job",
    ),
    "resume": (
        "continue a run from its newest complete checkpoint",
        "yatt_apps.cli.main:resume_main",
        "resume",
    ),
    "export": (
        "write a run's trained policy (newest checkpoint, or --step N) as an HF folder, LoRA merged "
        "(--adapter: a LoRA run's adapter alone, peft's format); a grpo-t2i run's as a diffusers folder",
        "yatt_apps.io.export:main",
        "plain",
    ),
    "merge": (
        "Bone Soup: merge saved backbones into one HF model for a preference over objectives",
        "yatt_apps.jobs.merge:main",
        "plain",
    ),
}
JOB_MAIN = "yatt_apps.cli.main:job_main"


def commands() -> dict[str, tuple[str, str, str]]:
    """Every subcommand: the registry's jobs first (in registry order), then the plain commands."""
    from yatt_apps.jobs import registry

    jobs = {name: (job.help, JOB_MAIN, "job") for name, job in registry().items()}
    return {**jobs, **COMMANDS}


def _module(target: str):
    import importlib

    return importlib.import_module(target.split(":")[0])


def _load(target: str) -> Callable:
    return getattr(_module(target), target.split(":")[1])


# the keys a user sets most, for --help (`yatt config` prints every key with its doc)
MAIN_KEYS = """main keys (--set KEY=VALUE, or a YAML file with --config; `yatt config` lists every key):
  model.path, judge.path      an HF model folder or hub id (empty: a tiny model built from the config)
  data.train, data.val        .jsonl or .parquet rows with prompt, answer (and images for grpo-vlm)
  run.num_steps               training steps; run.prompts_per_step: prompts per step
  run.out_dir, run.name       the run directory is OUT_DIR/NAME-TIME (or --run-dir)
  sampling.n                  completions per prompt; sampling.max_new_tokens: longest response
  optim.lr                    learning rate; algo.kl_loss_coef: KL loss term
  learner.lora_rank           > 0 trains LoRA adapters; syncs them alone (merged on export)
  controller.checkpoint_every checkpoint every k steps (what resume and export read)
  placement.mode              colocated, partial, disaggregated or dynamic
  log.wandb                   also log to Weights & Biases (log.project, log.run_name)"""


# preset -> its one-line summary for --help (the preset's docstring has the details); a preset without one
# shows the start of its docstring
PRESET_LINES: dict[str, str] = {
    "tiny_cpu": "the default: GRPO + rule rewards + a tiny GenRM judge, tiny Qwen2 models, minutes on CPU",
    "tiny_cpu_dapo": "yatt dapo's default: clip-higher, token-mean loss, overlong shaping, dynamic sampling",
    "tiny_cpu_ppo": "yatt ppo's default: a critic, GAE, KL as a reward penalty, rule rewards",
    "tiny_cpu_capo": "yatt capo's default: a rule verifier and the tiny judge as step critic (K=2)",
    "tiny_cpu_vlm": "yatt grpo-vlm's default: a tiny Qwen2-VL counting red squares in generated images",
    "qwen2_5_math_1_5b_genrm_72b": "the paper's recipe: Qwen2.5-Math-1.5B, a 72B judge, GSM8K, 64 GPUs",
}


def presets_help() -> str:
    """One line per preset: its name and summary."""
    from yatt_apps.jobs import presets

    def line(name: str, fn) -> str:
        doc = " ".join((fn.__doc__ or "").split())
        return PRESET_LINES.get(name) or (doc[:90] + "..." if len(doc) > 90 else doc)

    lines = [f"  {name:28} {line(name, fn)}" for name, fn in presets().items()]
    return "presets (--preset NAME):\n" + "\n".join(lines)


def add_job_options(cmd: argparse.ArgumentParser, *, job_option: bool) -> None:
    """The options of a command that builds a config: preset, YAML overlay, overrides, run directory."""
    if job_option:
        cmd.add_argument(
            "--job", help="the job whose config this is (a name or a job file; default: the preset's)"
        )
    cmd.add_argument(
        "--preset", help="a named preset (listed below; default: the job's own, tiny_cpu for grpo)"
    )
    cmd.add_argument("--config", help="a YAML file overlaying the preset")
    cmd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one field")
    cmd.add_argument("--run-dir", help="where the run writes (default: run.out_dir/run.name-TIME)")
    if not job_option:  # a job command: a folder that already holds a run is refused unless --overwrite
        cmd.add_argument(
            "--overwrite",
            action="store_true",
            help="--run-dir holds an earlier run: delete its records and checkpoints and start over there "
            "(without it such a folder is refused; `yatt resume RUN_DIR` continues it)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The `yatt` parser: one subcommand per registered job, and the plain commands."""
    epilog = f"{presets_help()}\n\n{MAIN_KEYS}"
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="yatt",
        description="YATT: RL post-training for LLMs and VLMs",
        epilog=epilog,
        formatter_class=raw,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, target, kind) in commands().items():
        cmd = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=epilog if kind in ("job", "file") else None,
            formatter_class=raw,
        )
        cmd.add_argument("--json", action="store_true", help="print only the JSON summary")
        if kind == "job":
            add_job_options(cmd, job_option=name in ("config", "plan"))
        if name == "plan":
            cmd.add_argument(
                "--calibrate",
                metavar="RUN_DIR",
                help="fit the placement simulator to a finished run's measured phase times and print its "
                "predicted step time for every rollout/judge split of that run's job and cluster",
            )
        elif kind == "file":
            cmd.add_argument("job_file", help="a Python file that defines JOB = JobDef(...)")
            add_job_options(cmd, job_option=False)
        elif kind == "plain":  # a plain command's own options: its module's optional add_arguments(parser)
            add_arguments = getattr(_module(target), "add_arguments", None)
            if add_arguments is not None:
                add_arguments(cmd)
        elif kind == "resume":
            cmd.add_argument("run_dir", help="a run directory written by a job command")
            cmd.add_argument("--job", help="the job file of a run started with `yatt run FILE.py`")
            cmd.add_argument(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="override one field of the saved config (e.g. run.num_steps to extend a run)",
            )
    return parser


def chosen_job(args: argparse.Namespace) -> JobDef | None:
    """The job a command names: `yatt NAME`, `yatt run FILE.py`, or `--job NAME|FILE` (config, plan,
    resume); None where the config's `app` decides (config and plan without --job)."""
    from yatt_apps.jobs import find, load_file

    name = getattr(args, "job_file", None) or getattr(args, "job", None)
    if name:
        return load_file(name) if name.endswith(".py") else find(name)
    if args.command in ("config", "plan", "resume"):
        return None
    return find(args.command)


def load_config(args: argparse.Namespace) -> tuple[RunConfig, JobDef]:
    """The run's config (the job's preset, or --preset, <- --config <- --set, `app` = the job's name) and job."""
    from yatt_apps.config import as_config
    from yatt_apps.jobs import find, presets
    from yatt_apps.overlay import build_config

    job = chosen_job(args)
    named = presets()
    if args.preset is not None and args.preset not in named:
        raise ValueError(f"--preset {args.preset!r} is not one of {sorted(named)}")
    if args.preset:
        base = named[args.preset]()
    elif job is not None:
        base = job.preset()
    else:
        base = named["tiny_cpu"]()
    if job is None:  # config / plan without --job: the preset's own job (or --set app=NAME)
        job = find(next((s.split("=", 1)[1].strip() for s in args.set if s.startswith("app=")), base.app))
    if type(base) is not job.config or base.app != job.name:
        base = as_config(job.config, base, app=job.name)
    check_keys(job, args.config, args.set)
    return build_config(job.config, base, args.config, args.set), job


def check_keys(job: JobDef, yaml_path: str | None, overrides: list[str]) -> None:
    """A key of another job's config (e.g. `capo` for ppo) is refused, naming the job it belongs to."""
    from yatt_apps.jobs import registry
    from yatt_apps.overlay import read_yaml

    keys = [item.split("=", 1)[0].split(".", 1)[0].strip() for item in overrides]
    keys += list(read_yaml(Path(yaml_path))) if yaml_path else []
    own = set(job.config.__struct_fields__)
    for key in keys:
        owners = sorted(
            {other.name for other in registry().values() if key in other.config.__struct_fields__}
        )
        if key not in own and owners:
            raise ValueError(
                f"{key!r} is a key of the {', '.join(owners)} job's config, not of {job.name}'s "
                f"({job.config.__name__}: {', '.join(job.config.__struct_fields__)})"
            )


def _run(cfg: RunConfig, job: JobDef, run_dir: str, args: argparse.Namespace, existing: Existing) -> int:
    from yatt_apps.runtime.interrupt import EXIT_INTERRUPTED, GUARD, interrupted_message
    from yatt_apps.runtime.launch import run_job

    try:
        summary = run_job(cfg, run_dir, job, existing=existing)
    except (KeyboardInterrupt, Exception) as err:  # run_job's cleanup has run: Ray is shut down
        if isinstance(err, OSError) and not err.filename and err.errno in DISK_ERRNOS:
            # a failed write() or flush() names no file: the run folder is what the job writes to
            raise OSError(err.errno, err.strerror, str(Path(run_dir).resolve())) from err
        if not (isinstance(err, KeyboardInterrupt) or GUARD.count):
            raise
        # after a Ctrl-C, an error from the cleanup (a Ray process that got the terminal's SIGINT too) is
        # part of the interruption, not a failed run
        print(interrupted_message(run_dir), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if not args.json:
        print(
            f"run {summary['run_dir']}: step {summary.get('step')} reward {summary.get('reward/mean', 0):.3f} "
            f"in {summary['seconds']:.1f}s; plot {summary['plot']}"
        )
    print(json.dumps(summary))
    return 0


def job_main(args: argparse.Namespace) -> int:
    """`yatt NAME`: run a registered job."""
    import time
    from pathlib import Path

    cfg, job = load_config(args)
    run_dir = args.run_dir or str(Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return _run(cfg, job, run_dir, args, "overwrite" if args.overwrite else "refuse")


def file_main(args: argparse.Namespace) -> int:
    """`yatt run FILE.py`: run the job a user's file declares, exactly as a registered one."""
    return job_main(args)


def finished_step(run_dir: str, num_steps: int) -> int | None:
    """The last step of a run that has done all `num_steps` steps, else None: its newest complete checkpoint
    is of the last step, or its final model is written and metrics.jsonl reached the last step."""
    from pathlib import Path

    from yatt_controller import checkpoint

    from yatt_apps.io.rundir import last_step

    found = checkpoint.latest(str(Path(run_dir) / "checkpoints"))
    logged = last_step(run_dir)
    if logged is None or logged < num_steps - 1:  # a killed driver may not have logged the last steps: the
        return None  # checkpoint holds their reports, which a resume writes (it starts at the checkpoint)
    if found is not None and found[1].step >= num_steps - 1:
        return found[1].step
    if (Path(run_dir) / "final" / "config.json").is_file():
        return logged
    return None


def resume_main(args: argparse.Namespace) -> int:
    """Continue a run; a finished run (every step done) says so and exits 0 without starting Ray."""
    from yatt_apps.jobs import find
    from yatt_apps.overlay import build_config, read_yaml

    path = Path(args.run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{args.run_dir} is not a run directory (no config.yaml)")
    job = chosen_job(args) or find(str(read_yaml(path).get("app", "grpo")))
    cfg = build_config(job.config, job.config(), path, args.set)
    done = finished_step(args.run_dir, cfg.run.num_steps)
    if done is not None:
        if not args.json:
            from yatt_apps.runtime.progress import yatt_command

            more = f"{yatt_command()} resume {args.run_dir} --set run.num_steps=N"
            print(f"run {args.run_dir} is finished: its last step ({done}) is done; to train longer: {more}")
        print(json.dumps({"run_dir": args.run_dir, "finished": True, "step": done}))
        return 0
    return _run(cfg, job, args.run_dir, args, "resume")


def config_main(args: argparse.Namespace) -> int:
    """Print the resolved config (preset <- --config <- --set) as YAML with a doc comment per key."""
    from yatt_apps.cli.keydocs import commented_yaml

    cfg, job = load_config(args)
    from yatt_apps.jobs import presets

    named = [name for name, fn in presets().items() if fn is job.preset]
    preset = args.preset or (named[0] if named else f"{job.name}'s own")
    print(f"# yatt config: preset {preset}" + (f", overlay {args.config}" if args.config else ""))
    print("\n".join(commented_yaml(cfg)))
    return 0


def plan_main(args: argparse.Namespace) -> int:
    import msgspec

    from yatt_apps.runtime.launch import placement_plan

    if args.calibrate:
        return calibrate_main(Path(args.calibrate), as_json=args.json)
    cfg, job = load_config(args)
    plan = placement_plan(cfg, job)
    if args.json:  # the PlacementPlan itself, for scripts
        print(msgspec.json.encode(plan).decode())
        return 0
    from yatt_placement.cli import render

    print(render(plan))  # the table alone: one row per role, device ids as ranges
    return 0


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def quiet_thread_disk_errors(args: threading.ExceptHookArgs) -> None:
    """A writer thread's full-disk error (TensorBoard's event writer) is raised again in the main thread on
    its next write, and reported there in one line: the thread's own traceback is not printed."""
    if isinstance(args.exc_value, OSError) and args.exc_value.errno in DISK_ERRNOS:
        return
    threading.__excepthook__(args)


def os_error_message(err: OSError) -> str:
    """One line for an OSError: what failed on which path, and what to do about a full or read-only disk."""
    message = f"{err.strerror or err}: {err.filename}" if err.filename else str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        message += " (free space on that disk, then `yatt resume` the run folder, or start over elsewhere)"
    elif err.errno == errno.EROFS:
        message += " (the disk is read-only: give --run-dir on a writable disk)"
    return message


def calibration_shape(cfg: Any, rows: list[dict[str, float]]) -> Any:
    """The batch shape of a run with a GenRM judge, for `yatt_placement.machine`: counts from its config,
    response length from its metrics. Prompt and grading-template lengths are those of the embedded
    arithmetic task's chat template and the verify_yes_no template (the metrics do not record them)."""
    from yatt_placement.machine import CallShape

    judge = next((spec.judge for spec in cfg.rewards if spec.kind == "genrm"), None)
    if judge is None:
        raise ValueError("yatt plan --calibrate: the run has no genrm reward: nothing to split")
    response = statistics.median(row.get("rollout/response_len_mean", 1.0) for row in rows)
    return CallShape(
        num_prompts=cfg.run.prompts_per_step,
        samples_per_prompt=cfg.sampling.n,
        judgements=judge.num_samples,
        prompt_tokens=25.0,
        response_tokens=response,
        max_response_tokens=2 * response,
        judge_prompt_tokens=120.0,
        verdict_tokens=3.0,
    )


def calibration_measured(rows: list[dict[str, float]]) -> dict[str, float]:
    """A run's median phase times per step (after its first), as `fit_machine` reads them."""
    steady = rows[1:] or rows
    if not steady or "time/rollout_s" not in steady[0]:
        raise ValueError("yatt plan --calibrate: the run's metrics.jsonl has no step with time/rollout_s")

    def median(key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in steady)

    outside = [
        r["time/step"] - r["time/rollout_reward"] - r["time/weight_sync"] - r.get("time/sleep", 0.0)
        for r in steady
    ]
    return {
        "rollout_s": median("time/rollout_s"),
        "reward_s": median("time/reward_s"),
        "trainer_s": statistics.median(outside),
        "sync_s": median("time/weight_sync"),
        "swap_s": median("time/sleep"),
    }


def calibrate_main(run_dir: Path, *, as_json: bool) -> int:
    """`yatt plan --calibrate RUN_DIR`: the machine model fitted to the run (on this machine's cores, the
    other load taken as none), then its step time under full colocation and every partial split."""
    import msgspec
    from yatt_placement.machine import fit_machine, step_time
    from yatt_placement.planner import lay_out

    from yatt_apps.io.export import run_config
    from yatt_apps.io.rundir import read_metrics
    from yatt_apps.jobs import find
    from yatt_apps.runtime.launch import placement_plan

    cfg, rows = run_config(run_dir), read_metrics(run_dir)
    if len(rows) < 2:
        raise ValueError(f"yatt plan --calibrate: {run_dir} has {len(rows)} logged steps; it needs 2 or more")
    job = find(cfg.app)
    shape, ran = calibration_shape(cfg, rows), placement_plan(cfg, job)
    model = fit_machine(calibration_measured(rows), shape, ran, len(os.sched_getaffinity(0)))
    cluster, roles = cfg.placement.cluster, job.roles(cfg)
    judges = [r.name or r.role for r in roles if r.role == "genrm"]
    predicted = {"colocated": step_time(model, shape, placement_plan(_mode(cfg, "colocated"), job)).step_s}
    for rollout in range(1, cluster.num_devices):
        counts = {r.name or r.role: cluster.num_devices for r in roles if r.role == "actor"}
        counts |= {"rollout": rollout, **dict.fromkeys(judges, cluster.num_devices - rollout)}
        try:
            split = lay_out(cluster, roles, "partial", counts)
        except ValueError:
            continue  # e.g. a judge's model-parallel size does not divide its share
        predicted[f"partial rollout {rollout} / judge {cluster.num_devices - rollout}"] = step_time(
            model, shape, split
        ).step_s
    best = min(predicted, key=lambda key: predicted[key])
    if as_json:
        print(json.dumps({"fitted": msgspec.to_builtins(model), "step_s": predicted, "best": best}))
        return 0
    print(f"fitted to {run_dir} ({ran.mode}, {len(rows)} steps), {model.physical_units} cores: {model}")
    for key, value in predicted.items():
        print(f"  {key:<32} {value:8.3f} s/step (predicted)" + ("  <- best" if key == best else ""))
    return 0


def _mode(cfg: Any, mode: str) -> Any:
    import msgspec

    return msgspec.structs.replace(cfg, placement=msgspec.structs.replace(cfg.placement, mode=mode))


def main(argv: Sequence[str] | None = None) -> int:
    from yatt_apps.runtime.interrupt import EXIT_INTERRUPTED, GUARD

    args = build_parser().parse_args(argv)
    threading.excepthook = quiet_thread_disk_errors
    try:
        with GUARD:
            return _load(commands()[args.command][1])(args)
    except KeyboardInterrupt:  # outside a run (a job's own is handled in _run): nothing to clean up
        print(f"yatt {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as err:
        print(f"yatt {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full or read-only disk, a permission: the path and the cause, no traceback
        print(f"yatt {args.command}: error: {os_error_message(err)}", file=sys.stderr)
        return 1
    except RuntimeError as err:  # a failed run (yatt_controller.ControllerFailure, a failed reward step)
        if os.environ.get("YATT_DEBUG"):  # the remote traceback, for developers
            traceback.print_exception(err.__cause__ or err)
        print(f"yatt {args.command}: run failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
