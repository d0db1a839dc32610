"""Verdict parsers and aggregation for generative judges.

Every parser maps one judgement's text to a verdict in [-1, 1], or None when the text states none. This is
WeChat-YATT's GenRM mapping (+1 "yes", -1 "no", 0 no verdict; reward = mean over the K judgements), with
numeric scores mapped linearly from `score_range` onto [-1, 1] so all parsers share one scale.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec

# The fixed verdict phrase the templates ask for; the last one in the text counts (a judge may quote the
# phrase while reasoning). `\boxed{Yes}` is accepted as the same verdict.
_YES_NO = re.compile(r"(?:verdict\s*[:：]\s*[*_`\s]*|\\boxed\{\s*)(yes|no)\b", re.IGNORECASE)
_SCORE = re.compile(r"score\s*[:=]\s*[*_`\s]*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_yes_no(text: str, score_range: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """`Verdict: Yes` -> 1.0, `Verdict: No` -> -1.0, neither -> None."""
    found = _YES_NO.findall(text)
    return None if not found else (1.0 if found[-1].lower() == "yes" else -1.0)


def _scaled(value: float, score_range: tuple[float, float]) -> float | None:
    low, high = score_range
    if not low <= value <= high:  # out of range is no verdict, not a clipped one
        return None
    return 2.0 * (value - low) / (high - low) - 1.0


def parse_score(text: str, score_range: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """`Score: 7` with range (0, 10) -> 2 * 7 / 10 - 1 = 0.4; a score outside the range -> None."""
    found = _SCORE.findall(text)
    return None if not found else _scaled(float(found[-1]), score_range)


def _last_json_object(text: str) -> dict | None:
    for start in reversed([i for i, ch in enumerate(text) if ch == "{"]):
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = msgspec.json.decode(text[start : end + 1])
                except msgspec.DecodeError:
                    break
                if isinstance(value, dict):
                    return value
                break
    return None


def parse_json(text: str, score_range: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """The last JSON object in the text: `{"verdict": "yes"|"no"}`, `{"correct": true|false}` or
    `{"score": x}` (x in `score_range`). Anything else -> None."""
    obj = _last_json_object(text)
    if obj is None:
        return None
    verdict = obj.get("verdict", obj.get("correct"))
    if isinstance(verdict, bool):
        return 1.0 if verdict else -1.0
    if isinstance(verdict, str) and verdict.strip().lower() in ("yes", "no"):
        return 1.0 if verdict.strip().lower() == "yes" else -1.0
    score = obj.get("score")
    if isinstance(score, int | float) and not isinstance(score, bool):
        return _scaled(float(score), score_range)
    return None


PARSERS: dict[str, Callable[[str, tuple[float, float]], float | None]] = {
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
