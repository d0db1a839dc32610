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
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence

# subcommand -> (help, "module:function" taking the parsed args and returning an exit code, kind)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "doctor": ("check the installation: packages, backends, devices, and a wire/codec/model round trip",
               "yatt_apps.cli.doctor:main", "plain"),
    "grpo": ("GRPO with rule rewards and a generative reward model (default: the tiny CPU run)",
             "yatt_apps.cli.main:job_main", "job"),
    "dapo": ("DAPO: GRPO with clip-higher, token-mean loss, overlong shaping and dynamic sampling (refill)",
             "yatt_apps.cli.main:job_main", "job"),
    "ppo": ("PPO with a critic (GAE, KL as a reward penalty, clipped value loss) on rule rewards",
            "yatt_apps.cli.main:job_main", "job"),
    "capo": ("CAPO: token-level credit from K step critiques of a GenPRM judge, rule verifier, PPO-clip",
             "yatt_apps.cli.main:job_main", "job"),
    "grpo-vlm": ("GRPO on a vision-language policy with image prompts (default: tiny Qwen2-VL, counting squares)",
                 "yatt_apps.jobs.vlm:job_main", "job"),
    "config": ("print the full resolved config as YAML, one doc comment per key (--preset, --config, --set)",
               "yatt_apps.cli.main:config_main", "job"),
    "sft": ("supervised fine-tuning on prompt/response rows (loss on the response); writes an HF folder",
            "yatt_apps.cli.main:job_main", "job"),
    "plan": ("print the placement plan of a config as a table (or --json)", "yatt_apps.cli.main:plan_main", "job"),
    "resume": ("continue a run from its newest complete checkpoint", "yatt_apps.cli.main:resume_main", "resume"),
    "export": ("write a run's trained policy (newest checkpoint, or --step N) as an HF folder, LoRA merged",
               "yatt_apps.io.export:main", "plain"),
    "merge": ("Bone Soup: merge saved backbones into one HF model for a preference over objectives",
              "yatt_apps.jobs.merge:main", "plain"),
}  # fmt: skip

# app name -> "module:JOB", the job's declaration (yatt_apps.runtime.job.JobDef): step, roles, services, checks
STEP_FACTORIES: dict[str, str] = {
    "grpo": "yatt_apps.jobs.grpo:JOB",
    "dapo": "yatt_apps.jobs.dapo:JOB",
    "ppo": "yatt_apps.jobs.ppo:JOB",
    "capo": "yatt_apps.jobs.capo:JOB",
    "grpo-vlm": "yatt_apps.jobs.vlm:JOB",
    "sft": "yatt_apps.jobs.sft:JOB",
}

# job command -> its preset when --preset is not given (otherwise tiny_cpu)
DEFAULT_PRESETS: dict[str, str] = {
    "dapo": "tiny_cpu_dapo",
    "ppo": "tiny_cpu_ppo",
    "capo": "tiny_cpu_capo",
    "grpo-vlm": "tiny_cpu_vlm",
    "sft": "tiny_cpu_sft",
}


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
  learner.lora_rank           > 0 trains LoRA adapters (merged into exported models)
  controller.checkpoint_every checkpoint every k steps (what resume and export read)
  placement.mode              colocated, partial or disaggregated
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
    from yatt_apps.config import PRESETS

    def line(name: str, fn) -> str:
        doc = " ".join((fn.__doc__ or "").split())
        return PRESET_LINES.get(name) or (doc[:90] + "..." if len(doc) > 90 else doc)

    lines = [f"  {name:28} {line(name, fn)}" for name, fn in PRESETS.items()]
    return "presets (--preset NAME):\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    epilog = f"{presets_help()}\n\n{MAIN_KEYS}"
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="yatt",
        description="YATT: RL post-training for LLMs and VLMs",
        epilog=epilog,
        formatter_class=raw,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _, kind) in COMMANDS.items():
        job = kind == "job"
        cmd = sub.add_parser(
            name, help=help_text, description=help_text, epilog=epilog if job else None, formatter_class=raw
        )
        cmd.add_argument("--json", action="store_true", help="print only the JSON summary")
        if kind == "job":
            cmd.add_argument(
                "--preset",
                help="a named preset (listed below; default: tiny_cpu, or tiny_cpu_APP for the other apps)",
            )
            cmd.add_argument("--config", help="a YAML file overlaying the preset")
            cmd.add_argument(
                "--set", action="append", default=[], metavar="KEY=VALUE", help="override one field"
            )
            cmd.add_argument("--run-dir", help="where the run writes (default: run.out_dir/run.name-TIME)")
        elif kind == "plain":  # a plain command's own options: its module's optional add_arguments(parser)
            add_arguments = getattr(_module(COMMANDS[name][1]), "add_arguments", None)
            if add_arguments is not None:
                add_arguments(cmd)
        elif kind == "resume":
            cmd.add_argument("run_dir", help="a run directory written by a job command")
            cmd.add_argument(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="override one field of the saved config (e.g. run.num_steps to extend a run)",
            )
    return parser


def load_config(args: argparse.Namespace):
    from yatt_apps.config import PRESETS, RunConfig
    from yatt_apps.overlay import build_config

    preset = args.preset or DEFAULT_PRESETS.get(args.command, "tiny_cpu")
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is not one of {sorted(PRESETS)}")
    cfg = build_config(RunConfig, PRESETS[preset](), args.config, args.set)
    if args.command in STEP_FACTORIES and cfg.app != args.command:
        cfg = build_config(RunConfig, cfg, None, [f"app={args.command}"])
    return cfg


def _run(cfg, run_dir: str, args: argparse.Namespace) -> int:
    from yatt_apps.runtime.interrupt import EXIT_INTERRUPTED, GUARD, interrupted_message
    from yatt_apps.runtime.launch import run_job

    if cfg.app not in STEP_FACTORIES:
        raise ValueError(f"app {cfg.app!r} is not one of {sorted(STEP_FACTORIES)}")
    try:
        summary = run_job(cfg, run_dir, _load(STEP_FACTORIES[cfg.app]))
    except (KeyboardInterrupt, Exception) as err:  # run_job's cleanup has run: Ray is shut down
        if not (isinstance(err, KeyboardInterrupt) or GUARD.count):
            raise
        # after a Ctrl-C, an error from the cleanup (a Ray process that got the terminal's SIGINT too) is
        # part of the interruption, not a failed run
        print(interrupted_message(run_dir), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if not args.json:
        print(f"run {summary['run_dir']}: step {summary.get('step')} reward {summary.get('reward/mean', 0):.3f} "
              f"in {summary['seconds']:.1f}s; plot {summary['plot']}")  # fmt: skip
    print(json.dumps(summary))
    return 0


def job_main(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    cfg = load_config(args)
    run_dir = args.run_dir or str(Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return _run(cfg, run_dir, args)


def finished_step(run_dir: str, num_steps: int) -> int | None:
    """The last step of a run that has done all `num_steps` steps, else None: its newest complete checkpoint
    is of the last step, or its final model is written and metrics.jsonl reached the last step."""
    from pathlib import Path

    from yatt_controller import checkpoint

    from yatt_apps.io.rundir import last_step

    found = checkpoint.latest(str(Path(run_dir) / "checkpoints"))
    if found is not None and found[1].step >= num_steps - 1:
        return found[1].step
    logged = last_step(run_dir)
    if (Path(run_dir) / "final" / "config.json").is_file() and logged is not None and logged >= num_steps - 1:
        return logged
    return None


def resume_main(args: argparse.Namespace) -> int:
    """Continue a run; a finished run (every step done) says so and exits 0 without starting Ray."""
    from pathlib import Path

    from yatt_apps.config import RunConfig
    from yatt_apps.overlay import build_config

    path = Path(args.run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{args.run_dir} is not a run directory (no config.yaml)")
    cfg = build_config(RunConfig, RunConfig(), path, args.set)
    done = finished_step(args.run_dir, cfg.run.num_steps)
    if done is not None:
        if not args.json:
            more = f"yatt resume {args.run_dir} --set run.num_steps=N"
            print(f"run {args.run_dir} is finished: its last step ({done}) is done; to train longer: {more}")
        print(json.dumps({"run_dir": args.run_dir, "finished": True, "step": done}))
        return 0
    return _run(cfg, args.run_dir, args)


def config_main(args: argparse.Namespace) -> int:
    """Print the resolved config (preset <- --config <- --set) as YAML with a doc comment per key."""
    from yatt_apps.cli.keydocs import commented_yaml

    cfg = load_config(args)
    preset = args.preset or DEFAULT_PRESETS.get(args.command, "tiny_cpu")
    print(f"# yatt config: preset {preset}" + (f", overlay {args.config}" if args.config else ""))
    print("\n".join(commented_yaml(cfg)))
    return 0


def plan_main(args: argparse.Namespace) -> int:
    import msgspec

    from yatt_apps.runtime.launch import placement_plan

    cfg = load_config(args)
    plan = placement_plan(cfg, _load(STEP_FACTORIES[cfg.app]))
    if not args.json:
        print(f"mode {plan.mode} on {plan.num_devices} devices: {plan.reason}")
        for role in plan.roles:
            label = role.role + (f":{role.name}" if role.name else "")
            print(f"  {label:10} {len(role.replicas):3} replica(s)  devices {role.replicas}")
    print(msgspec.json.encode(plan).decode())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from yatt_apps.runtime.interrupt import EXIT_INTERRUPTED, GUARD

    args = build_parser().parse_args(argv)
    try:
        with GUARD:
            return _load(COMMANDS[args.command][1])(args)
    except KeyboardInterrupt:  # outside a run (a job's own is handled in _run): nothing to clean up
        print(f"yatt {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as err:
        print(f"yatt {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a failed run (yatt_controller.ControllerFailure, a failed reward step)
        if os.environ.get("YATT_DEBUG"):  # the remote traceback, for developers
            traceback.print_exception(err.__cause__ or err)
        print(f"yatt {args.command}: run failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
