"""Verdict parsers and aggregation for generative judges.

Every parser maps one judgement's text to a verdict in [-1, 1], or None when the text states none. This is
WeChat-YATT's GenRM mapping (+1 "yes", -1 "no", 0 no verdict; reward = mean over the K judgements), with
numeric scores mapped linearly from `score_range` onto [-1, 1] so all parsers share one scale.

Which verdict counts: the FIRST one the judge states itself after its reasoning. Its reasoning is a
`<think>...</think>` block when it writes one (verdicts inside are drafts; an unclosed block states none).
A verdict is not the judge's own when it is copied from its prompt: a judge that quotes the response (or the
instruction, which names both verdicts) copies any verdict phrase written there. `quoted` are the prompt's
texts; a verdict phrase whose surroundings (`ECHO_CONTEXT` characters around it) occur verbatim in one of
them is an echo and skipped. The last verdict does not win: text after the judge's verdict (a quote of the
response) cannot overturn it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import msgspec

# The fixed verdict phrase the templates ask for. `\boxed{Yes}` is accepted as the same verdict.
_YES_NO = re.compile(r"(?:verdict\s*[:：]\s*[*_`\s]*|\\boxed\{\s*)(yes|no)\b", re.IGNORECASE)
_SCORE = re.compile(r"score\s*[:=]\s*[*_`\s]*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# Characters around a verdict phrase that must be a verbatim copy of a quoted text for it to be an echo.
ECHO_CONTEXT = 16


class ParseVerdict(Protocol):
    """A verdict parser: one judgement's text -> a verdict in [-1, 1], or None."""

    def __call__(
        self, text: str, score_range: tuple[float, float] = (0.0, 10.0), *, quoted: Sequence[str] = ()
    ) -> float | None: ...


def after_reasoning(text: str) -> str:
    """The text after the judge's `<think>` block (all of it when there is none; "" when it never closes)."""
    if _THINK_CLOSE in text:
        return text[text.rindex(_THINK_CLOSE) + len(_THINK_CLOSE) :]
    return "" if _THINK_OPEN in text else text


def is_echo(text: str, start: int, end: int, quoted: Sequence[str]) -> bool:
    """True when `text[start:end]` with `ECHO_CONTEXT` characters around it (as many as `text` has beyond the
    span) occurs verbatim in one of `quoted`. A span that is all of `text` is never an echo."""
    need = min(ECHO_CONTEXT, len(text) - (end - start))
    if need <= 0 or not quoted:
        return False
    for left in range(need + 1):
        lo, hi = start - left, end + need - left
        if lo >= 0 and hi <= len(text) and any(text[lo:hi] in q for q in quoted):
            return True
    return False


def own_matches(pattern: re.Pattern[str], text: str, quoted: Sequence[str]) -> Iterator[re.Match[str]]:
    """Matches of `pattern` after the judge's reasoning that are not echoes of `quoted`, in order."""
    own = after_reasoning(text)
    return (m for m in pattern.finditer(own) if not is_echo(own, m.start(), m.end(), quoted))


def parse_yes_no(
    text: str, score_range: tuple[float, float] = (0.0, 10.0), *, quoted: Sequence[str] = ()
) -> float | None:
    """The first own `Verdict: Yes` -> 1.0 / `Verdict: No` -> -1.0; none -> None."""
    first = next(own_matches(_YES_NO, text, quoted), None)
    return None if first is None else (1.0 if first.group(1).lower() == "yes" else -1.0)


def _scaled(value: float, score_range: tuple[float, float]) -> float | None:
    low, high = score_range
    if not low <= value <= high:  # out of range is no verdict, not a clipped one
        return None
    return 2.0 * (value - low) / (high - low) - 1.0


def parse_score(
    text: str, score_range: tuple[float, float] = (0.0, 10.0), *, quoted: Sequence[str] = ()
) -> float | None:
    """The first own `Score: 7` with range (0, 10) -> 2 * 7 / 10 - 1 = 0.4; a score outside the range -> None."""
    first = next(own_matches(_SCORE, text, quoted), None)
    return None if first is None else _scaled(float(first.group(1)), score_range)


def _json_objects(text: str, quoted: Sequence[str]) -> Iterator[dict]:
    """The JSON objects in `text` that are not echoes of `quoted`, in order of their opening brace."""
    for start in [i for i, ch in enumerate(text) if ch == "{"]:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = msgspec.json.decode(text[start : end + 1])
                except msgspec.DecodeError:
                    break
                if isinstance(value, dict) and not is_echo(text, start, end + 1, quoted):
                    yield value
                break


def parse_json(
    text: str, score_range: tuple[float, float] = (0.0, 10.0), *, quoted: Sequence[str] = ()
) -> float | None:
    """The first own JSON object that states a verdict: `{"verdict": "yes"|"no"}`, `{"correct": true|false}`
    or `{"score": x}` (x in `score_range`). None if no object does."""
    for obj in _json_objects(after_reasoning(text), quoted):
        value = _json_verdict(obj, score_range)
        if value is not None:
            return value
    return None


def _json_verdict(obj: dict, score_range: tuple[float, float]) -> float | None:
    verdict = obj.get("verdict", obj.get("correct"))
    if isinstance(verdict, bool):
        return 1.0 if verdict else -1.0
    if isinstance(verdict, str) and verdict.strip().lower() in ("yes", "no"):
        return 1.0 if verdict.strip().lower() == "yes" else -1.0
    score = obj.get("score")
    if isinstance(score, int | float) and not isinstance(score, bool):
        return _scaled(float(score), score_range)
    return None


PARSERS: dict[str, ParseVerdict] = {
    "yes_no": parse_yes_no,
    "score": parse_score,
    "json": parse_json,
}


def aggregate_mean(verdicts: Sequence[float | None]) -> float | None:
    """Mean over all K judgements with no-verdict as 0 (the paper's rule); None when none parsed."""
    if all(v is None for v in verdicts):
        return None
    return sum(v or 0.0 for v in verdicts) / len(verdicts)


def aggregate_majority(verdicts: Sequence[float | None]) -> float | None:
    """The most common parsed verdict; a tie between values gives their mean (Yes/No 2:2 -> 0.0)."""
    counts = Counter(v for v in verdicts if v is not None)
    if not counts:
        return None
    top = max(counts.values())
    tied = [v for v, c in counts.items() if c == top]
    return sum(tied) / len(tied)


AGGREGATIONS: dict[str, Callable[[Sequence[float | None]], float | None]] = {
    "mean": aggregate_mean,
    "majority": aggregate_majority,
}
