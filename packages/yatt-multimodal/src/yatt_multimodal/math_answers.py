"""Math answer verification: boxed-answer extraction and equivalence against a reference.

Two backends: `math_verify` (the `math-verify` package, Hugging Face's LaTeX/expression verifier) and `sympy`
(this module's own check: a small LaTeX-to-sympy normaliser, a whitelist of tokens, then symbolic and numeric
equality). `backend="auto"` uses math-verify where it is installed. Both run with their own timeouts off:
math-verify's timeout uses `signal.alarm`, which fails outside the main thread and cannot interrupt a C call
(a huge integer power) anyway. The time is bounded by running the rule in a killable worker process
(`yatt_multimodal.rule_workers`, which `rules.build_rule` uses); math-verify's notice that its own timeout is
off ("Timeout is disabled ...") is therefore expected and filtered from its loggers, nothing else is.

Before either backend runs, an answer holding a literal power or factorial of more than `MAX_ANSWER_DIGITS`
digits is judged wrong without being evaluated (`oversized_answer`): a policy under RL writes such answers
(`42^4441444444444`, seen in the tiny GRPO job within 100 steps), and each would hold its step for the whole
deadline. Other runaway answers (a symbolic power to expand, `(x+1)^{100000}`) still meet the deadline.
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from typing import Literal

MathBackend = Literal["auto", "math_verify", "sympy"]

# parses each process keeps: references and short boxed answers (a step's prompts are far fewer; a parse is a
# few sympy objects); a boxed answer longer than MAX_CACHED_ANSWER_CHARS is parsed each time
PARSE_CACHE_SIZE = 4096
MAX_CACHED_ANSWER_CHARS = 256

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if absent
    or unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


# CPython's limit on converting an int to text (sys.int_info.default_max_str_digits): no reference states an
# answer longer than that, and a value this long is what evaluating a runaway power or factorial heads for
MAX_ANSWER_DIGITS = 4300
# a number starts where no digit precedes it, and its digits are never given back: a long run of digits is
# scanned once, not once per position in it; `1e99`-style values are this module's own (a reduced level)
_NUMBER = r"(?<![\d.])(\d++(?:\.\d++)?(?:e\d++)?)"
_POWER = re.compile(_NUMBER + r"\s*(?:\^|\*\*)\s*(?:\{\s*" + _NUMBER + r"\s*\}|" + _NUMBER + ")")
_FACTORIAL = re.compile(r"(?<!\d)(\d++)\s*!(?!=)")  # `!=` is no factorial
_MAX_REDUCTIONS = 64  # powers reduced in one answer (a tower reduces one level each) before giving up


def oversized_answer(text: str) -> bool:
    """Whether `text` holds a literal factorial `n!` or power `a^b` (`^`, `**`, `^{b}`; a tower is reduced from
    the inside out) whose value has more than MAX_ANSWER_DIGITS digits. Estimated from logarithms: nothing
    that large is computed."""
    for match in _FACTORIAL.finditer(text):
        n = match.group(1).lstrip("0")
        if len(n) > 6 or math.lgamma(int(n or "0") + 1) / math.log(10) > MAX_ANSWER_DIGITS:
            return True
    for _ in range(_MAX_REDUCTIONS):
        matches = list(_POWER.finditer(text))
        if not matches:
            return False
        last = matches[-1]  # the innermost level of a tower, whose value is the next level's exponent
        base_text, exponent_text = last.group(1), last.group(2) or last.group(3)
        base, exponent = float(base_text), float(exponent_text)  # a digit string past 1e308 reads as inf
        digits = exponent * math.log10(base) if base > 1 and exponent > 0 else 0.0
        if digits > MAX_ANSWER_DIGITS:
            return True
        if base <= 1 or exponent == 0:
            value = "1" if base == 1 or exponent == 0 else "0"
        elif digits < 15 and not {".", "e"} & set(base_text + exponent_text):
            value = str(int(base_text) ** int(exponent_text))
        else:
            value = f"1e{int(digits)}"  # its number of digits: all the next level reads
        text = text[: last.start()] + value + text[last.end() :]
    return False


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def verify_math(response: str, reference: str, *, backend: MathBackend = "auto") -> bool:
    """True when the final answer in `response` equals `reference` mathematically (`1/2`, `0.5` and
    `\\frac{1}{2}` are one answer). A response with no extractable answer is wrong, never an error; so is one
    whose answer (the boxed one, else the whole response) holds a power or factorial of more than
    MAX_ANSWER_DIGITS digits (`oversized_answer`), unevaluated."""
    if not reference.strip():
        raise ValueError("verify_math: reference is empty; a math reward needs the expected answer")
    boxed = extract_boxed(response)
    if oversized_answer(response if boxed is None else boxed):
        return False
    if backend == "auto":
        backend = "math_verify" if math_verify_available() else "sympy"
    if backend == "math_verify":
        return _verify_with_math_verify(response, reference)
    if backend == "sympy":
        return _verify_with_sympy(response, reference)
    raise ValueError(f"verify_math: backend must be auto, math_verify or sympy, got {backend!r}")


def _as_latex(text: str) -> str:
    # math-verify extracts from LaTeX environments; a bare gold like `\sqrt{2}/2` parses only inside $...$.
    return text if "$" in text or "\\boxed" in text else f"${text}$"


# --- sympy's parse namespace, built once ------------------------------------------------------------------


@lru_cache(maxsize=1)
def sympy_namespace() -> dict:
    """The globals sympy's `parse_expr` builds for every call given no `global_dict`: `from sympy import *`,
    Python's builtin functions, and `max`/`min` as sympy's `Max`/`Min` (the same names bound to the same
    objects). Building it walks sympy's ~900 exported names: 0.17 ms in a small process, 0.3-0.7 ms in a
    large one, for every number and expression math-verify parses (`Number("25")` goes through it too). Built
    once here; each parse gets a copy (5 us), as eval adds `__builtins__` to the dict it is given."""
    import builtins
    import types

    import sympy

    namespace: dict = {}
    exec("from sympy import *", namespace)
    for name, obj in vars(builtins).items():
        if isinstance(obj, types.BuiltinFunctionType):
            namespace[name] = obj
    namespace["max"], namespace["min"] = sympy.Max, sympy.Min
    return namespace


def share_sympy_namespace() -> None:
    """Make sympy's `parse_expr` (and so `sympify` of a string, and math-verify's expression parser) use a copy
    of `sympy_namespace()` when it is given no `global_dict`, instead of building it again: the same parse,
    ~0.3 ms less each. It replaces `sympy.parsing.sympy_parser.parse_expr` (and the names math-verify and
    `sympy.parsing` imported) for the whole process, so YATT calls it only in processes of its own: the rule
    workers (`rule_workers`). Idempotent."""
    import sys

    from sympy.parsing import sympy_parser

    original = sympy_parser.parse_expr
    if getattr(original, "shares_namespace", False):
        return
    namespace = sympy_namespace()

    def parse_expr(
        s,
        local_dict=None,
        transformations=sympy_parser.standard_transformations,
        global_dict=None,
        evaluate=True,
    ):
        if global_dict is None:
            global_dict = dict(namespace)
        return original(
            s,
            local_dict=local_dict,
            transformations=transformations,
            global_dict=global_dict,
            evaluate=evaluate,
        )

    parse_expr.__doc__, parse_expr.shares_namespace = original.__doc__, True  # type: ignore[attr-defined]
    for module in ("sympy.parsing.sympy_parser", "sympy.parsing", "math_verify.parser"):
        if module in sys.modules and getattr(sys.modules[module], "parse_expr", None) is original:
            sys.modules[module].parse_expr = parse_expr  # type: ignore[attr-defined]


class _TimeoutOffNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: the timeout is off on purpose (see the docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@lru_cache(maxsize=1)  # once a process: it ran for every answer (18 us, two getLogger and a filter scan)
def _quiet_timeout_notice() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):  # the two modules that warn
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TimeoutOffNotice) for f in logger.filters):
            logger.addFilter(_TimeoutOffNotice())


def _verify_with_math_verify(response: str, reference: str) -> bool:
    from math_verify import parse, verify

    _quiet_timeout_notice()

    gold = _parsed(_as_latex(reference))
    boxed = extract_boxed(response)
    if boxed is not None and len(boxed) <= MAX_CACHED_ANSWER_CHARS:
        target = list(_parsed(f"${boxed}$"))
    else:
        target = parse(f"${boxed}$" if boxed is not None else response, parsing_timeout=None)
    if not gold or not target:
        return False
    return bool(verify(list(gold), target, timeout_seconds=None))


@lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parsed(latex: str) -> tuple:
    """math-verify's parse of `latex` (a reference, or a short boxed answer), once per process for each of the
    latest: a group's n responses share their reference, and often their answer. The reference's parse was most
    of what grading cost (0.14 of 0.19 ms a response on the tiny job's); each parse of an expression also runs
    sympy's `from sympy import *` (0.3 ms). `parse` is a function of the string alone and `verify` leaves its
    arguments unchanged (sympy expressions are immutable), so a cached parse gives the same verdicts."""
    from math_verify import parse

    return tuple(parse(latex, parsing_timeout=None))


# --- the sympy backend -------------------------------------------------------------------------------------

_LATEX_REWRITES = [
    (re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\$"), ""),
    (re.compile(r"\\(?:d|t)?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"((\1)/(\2))"),
    (re.compile(r"\\(?:d|t)?frac\s*(\d)\s*(\d)"), r"((\1)/(\2))"),
    (re.compile(r"\\sqrt\s*\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\sqrt\s*(\d)"), r"sqrt(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\pi"), "pi"),
    (re.compile(r"\^"), "**"),
    (re.compile(r"[{]"), "("),
    (re.compile(r"[}]"), ")"),
    (re.compile(r"(?<=\d),(?=\d{3}\b)"), ""),  # thousands separators: 1,000 -> 1000
]
# After normalisation only these identifiers may remain: parse_expr evaluates Python, so nothing else passes.
_ALLOWED_NAMES = {"sqrt", "pi", "exp", "log", "sin", "cos", "tan"}
_SAFE_CHARS = re.compile(r"^[0-9a-zA-Z+\-*/().\s]*$")
_FINAL_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _final_answer_text(response: str) -> str | None:
    boxed = extract_boxed(response)
    if boxed is not None or _BOXED.search(response):  # an unclosed box is a malformed answer, not none
        return boxed
    tail = re.split(r"answer is|answer:", response, flags=re.IGNORECASE)[-1]
    numbers = _FINAL_NUMBER.findall(tail.replace(",", ""))
    return numbers[-1] if numbers else None


def _normalise(latex: str) -> str | None:
    text = latex.strip().rstrip(".")
    for _ in range(3):  # nested \frac{\frac{..}{..}}{..} unwraps from the inside out
        for pattern, repl in _LATEX_REWRITES:
            text = pattern.sub(repl, text)
    if "=" in text:  # "x = 5" answers 5
        text = text.split("=")[-1]
    if not text.strip() or not _SAFE_CHARS.match(text):
        return None
    names = set(re.findall(r"[a-zA-Z]+", text))
    if any(len(name) > 1 and name not in _ALLOWED_NAMES for name in names):
        return None
    return text


@lru_cache(maxsize=PARSE_CACHE_SIZE)  # the references' parses stay; bounded: a worker lives for the run
def _to_sympy(text: str):
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    normalised = _normalise(text)
    if normalised is None:
        return None
    transformations = (*standard_transformations, implicit_multiplication_application, convert_xor)
    try:
        return parse_expr(
            normalised, transformations=transformations, global_dict=dict(sympy_namespace()), evaluate=True
        )
    except Exception:  # sympy raises SyntaxError, TokenError, TypeError... on malformed answers
        return None


def _verify_with_sympy(response: str, reference: str) -> bool:
    import sympy

    answer = _final_answer_text(response)
    if answer is None:
        return False
    gold, pred = _to_sympy(extract_boxed(reference) or reference), _to_sympy(answer)
    if gold is None or pred is None:
        return False
    try:
        if sympy.simplify(gold - pred) == 0:
            return True
        diff = complex(sympy.N(gold - pred))
    except (TypeError, ValueError, AttributeError):  # free symbols left or non-numeric expressions
        return False
    return abs(diff) <= 1e-6 * max(1.0, abs(complex(sympy.N(gold))))
