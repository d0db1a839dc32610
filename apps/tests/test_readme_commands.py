"""Every `yatt` command in the README's code blocks works as written (issue 34: the README's export example had
drifted): each is extracted from the README itself, parsed by the real CLI parser, its config built and checked
by its job exactly as `yatt` does before starting anything (unknown keys, bad values and impossible
combinations fail here), and an `export --step N` is checked against the checkpoints the block's earlier
commands keep (the runtime's schedule: every `checkpoint_every` steps and the last, the newest
`keep_checkpoints`). The README's first command, the default run, is run in full by the slow job tests.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from yatt_apps.cli.main import build_parser, load_config

README = Path(__file__).resolve().parents[2] / "README.md"
JOB_KINDS = {"resume", "export", "config", "plan", "doctor", "merge"}  # commands that are not a job run


def code_blocks(text: str) -> list[list[str]]:
    """The README's fenced code blocks, each a list of logical lines (backslash continuations joined)."""
    blocks, lines, inside = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if inside:
                blocks.append(lines)
            inside, lines = not inside, []
            continue
        if inside:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    return blocks


def yatt_argv(line: str) -> list[str] | None:
    """The argv after `yatt` of a README line that runs it (`uv run yatt ...`, `yatt ...`, after `&&` too),
    without its comment and the placeholder `...`; None for other lines."""
    command = line.split("&&")[-1].strip()
    if not re.search(r"(^|\s)yatt\s", command):  # prose in a block (a folder tree) need not be shell
        return None
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words[:2] == ["uv", "run"]:
        words = words[2:]
    if not words or words[0] != "yatt":
        return None
    return [w for w in words[1:] if w != "..."]


def readme_commands() -> list[tuple[int, list[str]]]:
    """(block number, argv) of every yatt command in the README."""
    return [
        (number, argv)
        for number, block in enumerate(code_blocks(README.read_text()))
        for line in block
        if (argv := yatt_argv(line)) is not None
    ]


def _set(argv: list[str], key: str) -> str | None:
    values = [
        argv[i + 1].split("=", 1)[1]
        for i, w in enumerate(argv[:-1])
        if w == "--set" and argv[i + 1].startswith(key + "=")
    ]
    return values[-1] if values else None


def kept_steps(runs: list[list[str]]) -> list[int]:
    """The checkpoints a folder holds after a job run and its resumes (argvs in order), by the runtime's rule:
    step s is saved when (s + 1) % checkpoint_every == 0 or s is the run's last; the newest `keep` remain."""
    args = build_parser().parse_args(runs[0])
    cfg, _ = load_config(args)
    every, keep = cfg.controller.checkpoint_every, cfg.controller.keep_checkpoints
    saved, start = [], 0
    for argv in runs:
        steps = int(_set(argv, "run.num_steps") or cfg.run.num_steps)
        saved += [s for s in range(start, steps) if every and ((s + 1) % every == 0 or s == steps - 1)]
        start = steps
    return saved[-keep:]


def test_the_readme_has_commands_to_check():
    commands = [argv[0] for _, argv in readme_commands()]
    assert commands[0] == "grpo" and {"run", "config", "resume", "export"} <= set(commands), commands


@pytest.mark.parametrize(
    ("block", "argv"), readme_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else str(v)
)
def test_every_readme_command_parses_and_its_config_is_accepted(block, argv, tmp_path):
    args = build_parser().parse_args(argv)  # argparse exits 2 on an unknown option: the test fails
    if args.command in JOB_KINDS - {"config", "plan"}:
        return  # checked below (export) or by their own tests (resume, doctor, merge)
    cfg, job = load_config(args)  # --set keys and values, --config overlays, the job's own keys
    if job.check is not None:
        job.check(cfg)


def test_the_readme_exports_a_step_its_run_kept():
    by_block: dict[int, list[list[str]]] = {}
    for block, argv in readme_commands():
        by_block.setdefault(block, []).append(argv)
    checked = 0
    for argvs in by_block.values():
        for i, argv in enumerate(argvs):
            if argv[0] != "export" or "--step" not in argv:
                continue
            folder = argv[1]
            runs = [a for a in argvs[:i] if ("--run-dir" in a and a[a.index("--run-dir") + 1] == folder)]
            runs += [a[:1] + a[2:] for a in argvs[:i] if a[0] == "resume" and a[1] == folder]
            assert runs, (
                f"README: `yatt {' '.join(argv)}` exports a run no earlier command of its block makes"
            )
            runs = [runs[0]] + [runs[0][:1] + r[1:] for r in runs[1:]]  # a resume continues the job's config
            step = int(argv[argv.index("--step") + 1])
            assert step in kept_steps(runs), (argv, kept_steps(runs))
            checked += 1
    assert checked >= 1
