"""The `yatt` command. Each subcommand is a thin parser over one app module, imported only when chosen,
so `yatt --help` stays fast."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# subcommand -> (help, "module:function" taking the parsed args and returning an exit code)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": (
        "check the installation: packages, backends, devices, and a wire/codec/model round trip",
        "yatt_apps.doctor:main",
    ),
}


def _load(target: str) -> Callable[[argparse.Namespace], int]:
    import importlib

    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yatt", description="YATT: RL post-training for LLMs and VLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--json", action="store_true", help="print only the JSON summary")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _load(COMMANDS[args.command][1])(args)


if __name__ == "__main__":
    sys.exit(main())
