"""The apps read placement as facts (issue 26): no code in apps/src compares a placement mode string, except
`runtime/job.py`, where `policy_roles` sizes the roles the planner places (the plan is made from it). An AST
scan; its own negative test shows what it flags."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "yatt_apps"
MODES = {"colocated", "partial", "disaggregated", "dynamic"}
ALLOWED = {"runtime/job.py"}  # policy_roles: replica counts the planner is given


def mode_comparisons(source: str, where: str) -> list[str]:
    """`where:line` of every comparison between something and a placement mode string (or a tuple of them)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(v, ast.Constant) and v.value in MODES for v in values):
                found.append(f"{where}:{node.lineno}")
                break
    return found


def test_the_scan_flags_mode_comparisons():
    snippet = (
        "if cfg.placement.mode == 'colocated': pass\n"
        "x = plan.mode in ('partial', 'dynamic')\n"
        "y = plan.sleeps\n"
        "z = name == 'actor'\n"
    )
    assert mode_comparisons(snippet, "m.py") == ["m.py:1", "m.py:2"]


def test_the_apps_read_placement_facts_not_mode_strings():
    found = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if (rel := path.relative_to(SRC).as_posix()) not in ALLOWED
        for hit in mode_comparisons(path.read_text(), rel)
    ]
    assert found == []
