"""No hidden module state (issue 26): what a call needs travels in an object its caller holds.

An AST scan of yatt-controller's and the apps' sources fails on
- a module-level binding of a mutable value (a dict/list/set literal or comprehension, or a call such as
  `deque()`, `defaultdict(...)`, `threading.Lock()`, `ThreadPoolExecutor(...)`) to a name that is not an
  ALL_CAPS constant, and
- any `global` statement.
ALL_CAPS names are constants (tables filled once where they are written, e.g. `PRESETS`, `COMMANDS`), and the
registries filled at import are listed in `ALLOWED` with their reason. Per-process caches are
`functools.cache`d functions, which this scan does not flag. Its own negative test shows what it flags.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "apps": ROOT / "apps" / "src",
    "controller": ROOT / "packages" / "yatt-controller" / "src",
}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
# calls that build immutable values or plain type aliases: not state
IMMUTABLE_CALLS = {
    "frozenset",
    "tuple",
    "TypeVar",
    "NewType",
    "namedtuple",
    "NamedTuple",
    "Literal",
    "object",
    "str",
    "int",
    "float",
    "bool",
    "bytes",
    "range",
    "Path",
    "getLogger",
    "re.compile",
    "compile",
    "ParamSpec",
    "field",
    "dataclass",
    "partial",
    "cast",
    "environ.get",
    "get",
}
# (path relative to its source root, name): registries filled at import, with why they are not state
ALLOWED: dict[tuple[str, str], str] = {}


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{base}.{func.attr}" if base else func.attr
    return ""


def _is_mutable(value: ast.expr | None) -> bool:
    if value is None:
        return False
    if isinstance(value, MUTABLE_LITERALS):
        return True
    if isinstance(value, ast.Call):
        name = _call_name(value)
        if not name:  # a decorator applied to a class (`ray.remote(...)(Cls)`): a class, not state
            return False
        return name not in IMMUTABLE_CALLS and name.rsplit(".", 1)[-1] not in IMMUTABLE_CALLS
    return False


def _is_constant_name(name: str) -> bool:
    """A public ALL_CAPS name (a table written once where it is defined) or a dunder (`__all__`). A private
    `_CACHE = {}` is not: a table nobody outside may read is state the module keeps for itself."""
    dunder = name.startswith("__") and name.endswith("__")
    return dunder or (name.isupper() and not name.startswith("_"))


def _targets(node: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    if isinstance(node, ast.Assign):
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        return [(n, node.value) for n in names]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [(node.target.id, node.value)]
    return []


def violations(source: str, where: str) -> list[str]:
    """Every module-level mutable binding to a non-constant name, and every `global`, in `source`."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        for name, value in _targets(node):
            if _is_mutable(value) and not _is_constant_name(name):
                found.append(f"{where}:{node.lineno}: module-level mutable binding {name!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{where}:{node.lineno}: global {', '.join(node.names)}")
    return found


def _scan(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for problem in violations(path.read_text(), rel):
            name = problem.split("'")[1] if "binding" in problem else ""
            if (rel, name) not in ALLOWED:
                out.append(problem)
    return out


def test_the_scan_flags_hidden_state():
    snippet = (
        "import collections\n"
        "_CACHE = {}\n"  # private: the module's own cache
        "TABLE = {'a': 1}\n"  # a public constant table: allowed
        "_seen = set()\n"
        "queues: dict = {}\n"
        "pending = collections.deque()\n"
        "NAMES = ('a', 'b')\n"
        "limit = 3\n"
        "def f():\n"
        "    global limit\n"
        "    local = {}\n"  # inside a function: not module state
        "    return local\n"
    )
    assert violations(snippet, "m.py") == [
        "m.py:2: module-level mutable binding '_CACHE'",
        "m.py:4: module-level mutable binding '_seen'",
        "m.py:5: module-level mutable binding 'queues'",
        "m.py:6: module-level mutable binding 'pending'",
        "m.py:10: global limit",
    ]


@pytest.mark.parametrize("package", sorted(SOURCES))
def test_no_hidden_module_state(package):
    assert _scan(SOURCES[package]) == []
