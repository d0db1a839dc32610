"""Types that are checked (issue 26): every public function and method of the five packages and the apps has
annotated parameters and an annotated return, so `tools/typecheck` has something to check.

Public: a module-level function or a method of a module-level class whose name does not start with `_`
(`__init__` counts, for its parameters; its return may be left out). `self`/`cls` and functions nested in
other functions are exempt. Its own negative test shows what it flags.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "apps": ROOT / "apps" / "src",
    **{p.name: p / "src" for p in sorted((ROOT / "packages").glob("yatt-*")) if (p / "src").is_dir()},
}


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool) -> list[str]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if method and params and params[0].arg in ("self", "cls") and not _is_static(fn):
        params = params[1:]
    missing = [p.arg for p in params if p.annotation is None]
    missing += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None and a.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        missing.append("return")
    return missing


def _is_static(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def unannotated(source: str, where: str) -> list[str]:
    """`where:line: name (missing ...)` for every public function or method lacking an annotation."""
    found = []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.parse(source).body:
        items = [(node, False)] if isinstance(node, functions) else []
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            items = [(item, True) for item in node.body if isinstance(item, functions)]
        for fn, method in items:
            if not _public(fn.name):
                continue
            missing = _missing(fn, method=method)
            if missing:
                found.append(f"{where}:{fn.lineno}: {fn.name} (missing {', '.join(missing)})")
    return found


def test_the_scan_flags_missing_annotations():
    snippet = (
        "def ok(a: int, *, b: str = '') -> int: ...\n"
        "def no_return(a: int): ...\n"
        "def no_param(a, b: int) -> None: ...\n"
        "def _private(a): ...\n"
        "class C:\n"
        "    def __init__(self, x): ...\n"
        "    def m(self, *args, **kw: int) -> None: ...\n"
        "    @staticmethod\n"
        "    def s(self) -> None: ...\n"
        "    def _p(self, y): ...\n"
        "    def __repr__(self): ...\n"
    )
    assert unannotated(snippet, "m.py") == [
        "m.py:2: no_return (missing return)",
        "m.py:3: no_param (missing a)",
        "m.py:6: __init__ (missing x)",
        "m.py:7: m (missing *args)",
        "m.py:9: s (missing self)",
    ]


@pytest.mark.parametrize("package", sorted(SOURCES))
def test_every_public_function_is_annotated(package):
    root = SOURCES[package]
    problems = [
        problem
        for path in sorted(root.rglob("*.py"))
        for problem in unannotated(path.read_text(), path.relative_to(root).as_posix())
    ]
    assert problems == [], f"{len(problems)} unannotated:\n" + "\n".join(problems)
