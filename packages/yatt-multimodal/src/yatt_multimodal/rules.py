"""Rule rewards: math answer verification, boxed-answer format, tag format, regex, exact match.

Each rule is a pure function `(RewardRequest, **options) -> float` in {0.0, 1.0}; `RULES` is the explicit
registry that `build_rule(spec)` reads, turning a `RewardSpec` (kind + string options) into a `RuleReward`
that runs in the killable worker processes of a `RuleWorkerPool`: every rule here reads policy output, and
math verification or a user's regex can run unbounded on it.
"""

from __future__ import annotations

import inspect
import re
import unicodedata
from collections.abc import Callable
from functools import partial

from yatt_multimodal.math_answers import MathBackend, extract_boxed, verify_math
from yatt_multimodal.rewards import RuleReward
from yatt_multimodal.rule_workers import RuleWorkerPool
from yatt_multimodal.types import RewardRequest, RewardSpec


def math_reward(request: RewardRequest, *, backend: MathBackend = "auto") -> float:
    """1.0 when the response's final answer equals `request.reference` mathematically."""
    return float(verify_math(request.response, request.reference, backend=backend))


def boxed_format_reward(request: RewardRequest) -> float:
    """1.0 when the response ends its reasoning with exactly one non-empty `\\boxed{...}` answer."""
    answer = extract_boxed(request.response)
    return float(bool(answer) and request.response.count("\\boxed") == 1)


def tag_format_reward(request: RewardRequest, *, tags: str = "think,answer") -> float:
    """1.0 when the response is exactly the given tags in order, each once, e.g. `<think>..</think>
    <answer>..</answer>` for tags="think,answer" (R1-style format reward), with only whitespace between."""
    names = [t.strip() for t in tags.split(",") if t.strip()]
    if not names:
        raise ValueError("tag_format_reward: option 'tags' names no tag")
    body = r"\s*".join(rf"<{re.escape(n)}>(?:(?!<{re.escape(n)}>).)*?</{re.escape(n)}>" for n in names)
    return float(re.fullmatch(rf"\s*{body}\s*", request.response, flags=re.DOTALL) is not None)


def regex_reward(request: RewardRequest, *, pattern: str, mode: str = "search") -> float:
    """1.0 when `pattern` matches the response (`mode`: "search" anywhere, "fullmatch" the whole text)."""
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"regex_reward: option 'mode' must be search or fullmatch, got {mode!r}")
    return float(getattr(re, mode)(pattern, request.response, flags=re.DOTALL) is not None)


def _normalise_text(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(text.replace(".", " ").split())


def exact_match_reward(request: RewardRequest, *, normalise: str = "true", use_boxed: str = "true") -> float:
    """1.0 when the answer equals the reference: the boxed answer if there is one (`use_boxed`), else the
    whole response; with `normalise`, case, Unicode width, periods and runs of spaces do not count."""
    answer = (extract_boxed(request.response) if use_boxed == "true" else None) or request.response
    if normalise == "true":
        return float(_normalise_text(answer) == _normalise_text(request.reference))
    return float(answer.strip() == request.reference.strip())


RULES: dict[str, Callable[..., float]] = {
    "math_verify": math_reward,
    "boxed_format": boxed_format_reward,
    "tag_format": tag_format_reward,
    "regex": regex_reward,
    "exact_match": exact_match_reward,
}


def build_rule(
    spec: RewardSpec,
    *,
    timeout_s: float = 10.0,
    max_concurrency: int = 8,
    pool: RuleWorkerPool | None = None,
) -> RuleReward:
    """The `RuleReward` a spec names; `spec.options` are passed to the rule as keyword arguments. It runs in
    `pool`, each request with a `timeout_s` deadline; without one it gets a pool of its own (at most
    `max_concurrency` and 4 workers), closed by its `close()`."""
    if spec.kind not in RULES:
        raise ValueError(f"RewardSpec.kind {spec.kind!r} is not a rule; rules are {sorted(RULES)}")
    rule = RULES[spec.kind]
    try:  # bad option names fail here, at build time, not on every request
        inspect.signature(rule).bind(None, **spec.options)
        if spec.kind == "regex":
            re.compile(spec.options.get("pattern", ""))
    except (TypeError, re.error) as exc:
        raise ValueError(f"RewardSpec.options for {spec.kind!r}: {exc}") from exc
    fn = partial(rule, **spec.options)
    owns = pool is None
    pool = pool or RuleWorkerPool(num_workers=min(max_concurrency, 4))
    return RuleReward(
        spec.name or spec.kind,
        fn,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
        pool=pool,
        owns_pool=owns,
    )
