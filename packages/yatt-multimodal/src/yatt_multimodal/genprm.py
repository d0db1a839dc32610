"""GenPRM for CAPO (arXiv 2508.02298): K one-pass step critiques per response -> K wrong-step sets, and each
step's span in the response's tokens.

A response is split into steps on `<step k>` markers when it has them, else on blank lines. An LLM critic
(through a yatt-rollout engine) sees the question, the numbered steps and optionally the reference, and ends
with `Wrong steps: 2, 5` or `Wrong steps: none`. The voting over the K sets (intersection, majority, union,
average) and the token rewards belong to yatt-algos' CAPO; this module stops at `StepCritique`.
Departure from the paper: a critique that names no parseable list, or a step number outside 1..num_steps,
is left out of the K sets and counted (`num_unparsed`); if no critique parses the status is `parse_error`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from yatt_rollout.types import GenerateRequest, Generator, Prompt

from yatt_multimodal.genrm import check_choices, judge_sampling
from yatt_multimodal.judge_calls import JudgeCall, sample_judgements
from yatt_multimodal.prompt_codecs import PromptCodec
from yatt_multimodal.templates import get_template
from yatt_multimodal.types import JudgeSpec, RewardRequest, StepCritique
from yatt_multimodal.verdicts import own_matches

# Explicit step markers: `<step 3>` anywhere, or `Step 3:` / `Step 3.` at a line start.
_MARKER = re.compile(r"<step\s*\d+\s*>|^[ \t]*step\s+\d+\s*[:.]", re.IGNORECASE | re.MULTILINE)
_CLOSING = re.compile(r"\s*</step\s*\d*\s*>\s*$", re.IGNORECASE)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_WRONG = re.compile(
    r"wrong\s+steps?\s*[:：]\s*[*_`\s]*(none|\[?\s*\d+(?:\s*(?:,|and)\s*\d+)*\s*\]?)", re.IGNORECASE
)

# CAPO's defaults: 4 critiques per response, the step-critique template. GenPRM reads wrong-step lists, so
# `parser` and `aggregation` of its spec are unused (voting is yatt-algos' job).
GENPRM_SPEC = JudgeSpec(template_name="step_critique", num_samples=4, parser="yes_no")


def split_steps(response: str) -> list[tuple[int, int]]:
    """Half-open char spans of the steps, surrounding whitespace excluded. With markers (`<step k>`, or
    `Step k:` at a line start) a step runs from its marker to the next (a closing `</step k>` is kept out);
    text before the first marker is not a step. Without markers, steps are the blank-line-separated
    paragraphs."""
    markers = list(_MARKER.finditer(response))
    if markers:
        bounds = [(m.start(), nxt.start()) for m, nxt in itertools.pairwise(markers)]
        bounds.append((markers[-1].start(), len(response)))
        bounds = [(s, s + len(_CLOSING.sub("", response[s:e]))) for s, e in bounds]
    else:
        cuts = [0, *(p for m in _BLANK_LINE.finditer(response) for p in (m.start(), m.end())), len(response)]
        bounds = list(zip(cuts[::2], cuts[1::2], strict=True))
    return [span for s, e in bounds if (span := _strip_span(response, s, e)) is not None]


def _strip_span(text: str, start: int, end: int) -> tuple[int, int] | None:
    chunk = text[start:end]
    if not chunk.strip():
        return None
    return start + len(chunk) - len(chunk.lstrip()), end - (len(chunk) - len(chunk.rstrip()))


def number_steps(response: str, spans: Sequence[tuple[int, int]]) -> str:
    """The steps as the critic sees them: `Step 1: ...` blocks, markers removed."""
    return "\n\n".join(
        f"Step {i + 1}: {_MARKER.sub('', response[s:e]).strip()}" for i, (s, e) in enumerate(spans)
    )


def parse_wrong_steps(text: str, num_steps: int, *, quoted: Sequence[str] = ()) -> set[int] | None:
    """`Wrong steps: 2, 5` -> {1, 4} (0-based); `none` -> set(); no such line or a number outside
    1..num_steps -> None. The first such line the critic writes itself after its reasoning counts, not one
    copied from `quoted` (its prompt's texts; `verdicts.own_matches`)."""
    first = next(own_matches(_WRONG, text, quoted), None)
    if first is None:
        return None
    found = first.group(1)
    if found.lower() == "none":
        return set()
    numbers = [int(n) for n in re.findall(r"\d+", found)]
    if any(not 1 <= n <= num_steps for n in numbers):
        return None
    return {n - 1 for n in numbers}


def token_offsets(tokenizer: Any, text: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Char span of every token of `token_ids` in `text`. Uses the fast tokenizer's offset mapping when
    re-tokenizing `text` gives back exactly `token_ids`; otherwise (a sampled tokenization differing from the
    canonical one) it decodes growing prefixes, which must reproduce `text` exactly."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) == list(token_ids):
        return [tuple(span) for span in enc["offset_mapping"]]
    offsets, prev = [], 0
    for t in range(len(token_ids)):
        end = len(tokenizer.decode(list(token_ids[: t + 1]), skip_special_tokens=True))
        offsets.append((prev, end))
        prev = end
    if tokenizer.decode(list(token_ids), skip_special_tokens=True) != text:
        raise ValueError("response_token_ids do not decode to the response text; cannot map steps to tokens")
    return offsets


def token_spans(
    char_spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Half-open token span of each step: the tokens whose chars overlap it. A token straddling a boundary
    belongs to the first step it overlaps, so spans never overlap (yatt-algos' CAPO convention); a
    zero-width token counts at its position; a step no token overlaps gets (0, 0)."""
    owner = [
        next((k for k, (s, e) in enumerate(char_spans) if a < e and s < max(b, a + 1)), -1)
        for a, b in offsets
    ]
    spans = []
    for k in range(len(char_spans)):
        tokens = [t for t, o in enumerate(owner) if o == k]
        spans.append((tokens[0], tokens[-1] + 1) if tokens else (0, 0))
    return spans


class GenPRM:
    """`critique(requests)` -> one `StepCritique` per request. `tokenizer` is the policy's (fast, HF)
    tokenizer: it maps step spans to positions in `response_token_ids` (or, when a request has none, in the
    response's own tokenization)."""

    def __init__(
        self, engine: Generator, codec: PromptCodec, spec: JudgeSpec = GENPRM_SPEC, *, tokenizer: Any
    ):
        self.spec, self.engine, self.codec, self.tokenizer = spec, engine, codec, tokenizer
        self.template = get_template(spec.template_name, spec.template_version)
        if self.template.parser != "wrong_steps":
            raise ValueError(
                f"GenPRM needs a step-critique template, got {spec.template_name}@{spec.template_version}"
            )
        check_choices(spec, lambda text: parse_wrong_steps(text, num_steps=1_000))

    def _prompt(self, request: RewardRequest, spans: list[tuple[int, int]]) -> Prompt:
        system, user = self.template.render(
            question=request.prompt,
            response=request.response,
            reference=request.reference,
            steps=number_steps(request.response, spans),
            num_steps=len(spans),
        )
        return Prompt(token_ids=self.codec.encode_prompt(system, user), text=user)

    def parse(self, text: str, num_steps: int, quoted: Sequence[str]) -> set[int] | None:
        """One critique's wrong steps: a constrained choice as it is, free text with echoes skipped."""
        if text in (self.spec.choices or []):
            return parse_wrong_steps(text, num_steps)
        return parse_wrong_steps(text, num_steps, quoted=quoted)

    async def critique(self, requests: Sequence[RewardRequest]) -> list[StepCritique]:
        steps = [split_steps(r.response) for r in requests]
        to_send = [
            GenerateRequest(
                request_id=f"p{i}", prompt=self._prompt(r, steps[i]), sampling=judge_sampling(self.spec)
            )
            for i, r in enumerate(requests)
            if steps[i]
        ]
        calls = await sample_judgements(
            self.engine, to_send, timeout_s=self.spec.timeout_s, max_concurrency=self.spec.max_concurrency
        )
        quoted = {g.request_id: (g.prompt.text or "", self.template.system) for g in to_send}
        return [
            self._result(r, steps[i], calls.get(f"p{i}"), quoted.get(f"p{i}", ()))
            for i, r in enumerate(requests)
        ]

    def _result(
        self,
        request: RewardRequest,
        spans: list[tuple[int, int]],
        call: JudgeCall | None,
        quoted: Sequence[str],
    ) -> StepCritique:
        out = StepCritique(request_id=request.request_id, char_spans=spans, token_spans=[], wrong_steps=[])
        try:
            ids = (
                request.response_token_ids
                or self.tokenizer(request.response, add_special_tokens=False)["input_ids"]
            )
            out.token_spans = token_spans(spans, token_offsets(self.tokenizer, request.response, ids))
        except ValueError as exc:
            out.status, out.error = "error", f"request {request.request_id}: {exc}"
            return out
        if call is None:  # nothing to critique: an empty response has no steps and no wrong steps
            return out
        if call.status != "ok":
            out.status, out.error = call.status, call.error
            return out
        out.critiques = [self.codec.decode(c.token_ids) for c in call.completions]
        parsed = [self.parse(text, len(spans), quoted) for text in out.critiques]
        out.wrong_steps = [sorted(p) for p in parsed if p is not None]
        out.num_unparsed = parsed.count(None)
        if not out.wrong_steps:
            out.status, out.error = "parse_error", f"no wrong-step list in any of {len(parsed)} critiques"
        return out
