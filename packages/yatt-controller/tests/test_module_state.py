"""No hidden module state in yatt-controller: no `global` statement and no module-level mutable binding other
than an UPPER_CASE registry or constant filled at import (what a call needs travels in objects callers hold:
a controller's `Dispatcher` holds its resend map, the run's `RosterBook` its roster)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "yatt_controller"
MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter"}


def _allowed(name: str) -> bool:
    """A public UPPER_CASE registry or constant, or a dunder (`__all__`); never a private binding."""
    return (name.startswith("__") and name.endswith("__")) or (name.isupper() and not name.startswith("_"))


def hidden_state(source: str) -> list[str]:
    """'line: name' of every `global` and every module-level mutable binding not `_allowed`."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [f"{node.lineno}: global {name}" for name in node.names]
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        mutable = isinstance(
            value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp
        ) or (
            isinstance(value, ast.Call)
            and getattr(value.func, "id", getattr(value.func, "attr", "")) in MUTABLE_CALLS
        )
        for target in targets:
            if mutable and isinstance(target, ast.Name) and not _allowed(target.id):
                found.append(f"{node.lineno}: {target.id}")
    return found


def test_the_controller_package_keeps_no_module_state():
    modules = sorted(SRC.glob("*.py"))
    assert len(modules) >= 20  # the whole package is read
    found = {path.name: hidden_state(path.read_text()) for path in modules}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_check_sees_the_resend_map_that_used_to_live_in_dispatch():
    old = "from collections import OrderedDict\n_RESEND: OrderedDict = OrderedDict()\n_cache = {}\nDISPATCH = {}\n"
    assert hidden_state(old) == ["2: _RESEND", "3: _cache"]
    assert hidden_state("def f():\n    global _n\n    _n = 1\n") == ["2: global _n"]
