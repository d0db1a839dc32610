"""Tools a model calls from an environment: a JSON-schema spec and a function from arguments to `ToolResult`.

`python_tool` runs code through `yatt_rollout.sandbox` (a failed run comes back with the sandbox's status);
`calculator_tool` evaluates integer arithmetic (`+ - * / ( )`, unary minus) with a small parser, never
`eval`. A tool never raises for its caller: bad arguments are a `malformed` result, a bad expression `error`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from yatt_rollout.types import ToolResult, ToolSpec


@dataclass(frozen=True)
class Tool:
    """A callable tool: `spec` is what the model sees, `fn(arguments)` what runs."""

    spec: ToolSpec
    fn: Callable[[dict[str, Any]], ToolResult]

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        return self.fn(arguments)


def _string_argument(arguments: dict[str, Any], key: str, tool: str) -> str | ToolResult:
    value = arguments.get(key)
    if not isinstance(value, str):
        got = "missing" if value is None else type(value).__name__
        return ToolResult(status="malformed", output=f"{tool}: argument {key!r} must be a string, got {got}")
    return value


# ---- calculator -----------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
MAX_EXPRESSION_CHARS = 256


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of an integer expression over `+ - * / ( )` (standard precedence, left to right,
    unary minus). ValueError for anything else, division by zero, or more than 256 characters."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = [m.group(1) or m.group(2) for m in _TOKEN.finditer(expression) if m.group(1) or m.group(2)]
    bad = next((t for t in tokens if not t.isdigit() and t not in "+-*/()"), None)
    if bad is not None:
        raise ValueError(f"unexpected character {bad!r}")
    value, rest = _sum(tokens)
    if rest:
        raise ValueError(f"unexpected {rest[0]!r}")
    return value


def _sum(tokens: list[str]) -> tuple[Fraction, list[str]]:
    value, tokens = _product(tokens)
    while tokens and tokens[0] in "+-":
        op, (rhs, tokens) = tokens[0], _product(tokens[1:])
        value = value + rhs if op == "+" else value - rhs
    return value, tokens


def _product(tokens: list[str]) -> tuple[Fraction, list[str]]:
    value, tokens = _unary(tokens)
    while tokens and tokens[0] in "*/":
        op, (rhs, tokens) = tokens[0], _unary(tokens[1:])
        if op == "/" and rhs == 0:
            raise ValueError("division by zero")
        value = value * rhs if op == "*" else value / rhs
    return value, tokens


def _unary(tokens: list[str]) -> tuple[Fraction, list[str]]:
    if not tokens:
        raise ValueError("unexpected end of expression")
    head, rest = tokens[0], tokens[1:]
    if head == "-":
        value, rest = _unary(rest)
        return -value, rest
    if head == "(":
        value, rest = _sum(rest)
        if not rest or rest[0] != ")":
            raise ValueError("missing ')'")
        return value, rest[1:]
    if head.isdigit():
        return Fraction(int(head)), rest
    raise ValueError(f"unexpected {head!r}")


def format_number(value: Fraction) -> str:
    """An integer as digits; otherwise a decimal with up to 10 significant digits."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


def calculator_tool() -> Tool:
    spec = ToolSpec(
        name="calculator",
        description="Evaluate an arithmetic expression over integers with + - * / and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
            "required": ["expression"],
        },
    )

    def run(arguments: dict[str, Any]) -> ToolResult:
        expression = _string_argument(arguments, "expression", "calculator")
        if isinstance(expression, ToolResult):
            return expression
        try:
            return ToolResult(status="ok", output=format_number(evaluate_arithmetic(expression)))
        except ValueError as err:
            return ToolResult(status="error", output=f"calculator: {err}")

    return Tool(spec, run)


# ---- python ---------------------------------------------------------------------------------------------


def python_tool(limits: Any = None) -> Tool:
    """Run Python code in the sandbox (`limits`: a `SandboxLimits`, default limits when None); the model
    sees stdout, and stderr too when the run failed."""
    from yatt_rollout.sandbox import SandboxLimits, run_python

    limits = limits or SandboxLimits()
    spec = ToolSpec(
        name="python",
        description="Run a Python program and return what it prints. No network; limited time and memory.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    )

    def run(arguments: dict[str, Any]) -> ToolResult:
        code = _string_argument(arguments, "code", "python")
        if isinstance(code, ToolResult):
            return code
        result = run_python(code, limits)
        if result.status == "ok":
            return ToolResult(status="ok", output=result.stdout)
        tail = (result.stdout + result.stderr)[-2000:]
        return ToolResult(status=result.status, output=f"python: {result.status}\n{tail}")

    return Tool(spec, run)
