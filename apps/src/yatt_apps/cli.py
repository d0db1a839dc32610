"""The `yatt` command. Each subcommand is a thin parser over one app module, imported only when chosen,
so `yatt --help` stays fast.

Job commands (`grpo`, ...) take a preset (`--preset`, default `tiny_cpu`), a YAML overlay (`--config`) and
`--set key=value` overrides; `yatt resume RUN_DIR` continues a run from its newest complete checkpoint.
Exit codes: 0 done, 1 the run failed, 2 bad input (config, data, arguments).
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
               "yatt_apps.doctor:main", "plain"),
    "grpo": ("GRPO with rule rewards and a generative reward model (default: the tiny CPU run)",
             "yatt_apps.cli:job_main", "job"),
    "dapo": ("DAPO: GRPO with clip-higher, token-mean loss, overlong shaping and dynamic sampling (refill)",
             "yatt_apps.cli:job_main", "job"),
    "ppo": ("PPO with a critic (GAE, KL as a reward penalty, clipped value loss) on rule rewards",
            "yatt_apps.cli:job_main", "job"),
    "capo": ("CAPO: token-level credit from K step critiques of a GenPRM judge, rule verifier, PPO-clip",
             "yatt_apps.cli:job_main", "job"),
    "grpo-vlm": ("GRPO on a vision-language policy with image prompts (default: tiny Qwen2-VL, counting squares)",
                 "yatt_apps.vlm:job_main", "job"),
    "sft": ("supervised fine-tuning on prompt/response rows (loss on the response); writes an HF folder", "yatt_apps.cli:job_main", "job"),
    "plan": ("print the placement plan of a config as a table (or --json)", "yatt_apps.cli:plan_main", "job"),
    "resume": ("continue a run from its newest complete checkpoint", "yatt_apps.cli:resume_main", "resume"),
    "merge": ("Bone Soup: merge saved backbones into one HF model for a preference over objectives",
              "yatt_apps.merge:main", "plain"),
}  # fmt: skip

# app name -> "module:function" returning the step function for (cfg, policy_dir, val_rows)
STEP_FACTORIES: dict[str, str] = {
    "grpo": "yatt_apps.grpo:step_function",
    "dapo": "yatt_apps.dapo:step_function",
    "ppo": "yatt_apps.ppo:step_function",
    "capo": "yatt_apps.capo:step_function",
    "grpo-vlm": "yatt_apps.vlm:step_function",
    "sft": "yatt_apps.sft:step_function",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yatt", description="YATT: RL post-training for LLMs and VLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _, kind) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--json", action="store_true", help="print only the JSON summary")
        if kind == "job":
            cmd.add_argument(
                "--preset",
                help="a named preset (see yatt_apps.config.PRESETS; default: tiny_cpu or tiny_cpu_APP)",
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
    from yatt_apps.launch import run_job

    if cfg.app not in STEP_FACTORIES:
        raise ValueError(f"app {cfg.app!r} is not one of {sorted(STEP_FACTORIES)}")
    summary = run_job(cfg, run_dir, _load(STEP_FACTORIES[cfg.app]))
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


def resume_main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from yatt_apps.config import RunConfig
    from yatt_apps.overlay import build_config

    path = Path(args.run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{args.run_dir} is not a run directory (no config.yaml)")
    return _run(build_config(RunConfig, RunConfig(), path, args.set), args.run_dir, args)


def plan_main(args: argparse.Namespace) -> int:
    import msgspec

    from yatt_apps.launch import placement_plan

    plan = placement_plan(load_config(args))
    if not args.json:
        print(f"mode {plan.mode} on {plan.num_devices} devices: {plan.reason}")
        for role in plan.roles:
            label = role.role + (f":{role.name}" if role.name else "")
            print(f"  {label:10} {len(role.replicas):3} replica(s)  devices {role.replicas}")
    print(msgspec.json.encode(plan).decode())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _load(COMMANDS[args.command][1])(args)
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
