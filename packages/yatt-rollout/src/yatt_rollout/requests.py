"""Checks every engine makes on a request before it runs, and the completions of a failed request.

A bad request fails alone: the engine answers it with `n` completions of `finish_reason="error"` whose
`error` names the request and what is wrong, and keeps serving the others.
"""

from __future__ import annotations

from yatt_rollout.types import Completion, GenerateRequest


def check_request(
    req: GenerateRequest, *, vocab_size: int, max_context: int, num_tokens: int | None = None
) -> None:
    """ValueError naming the request and the field. `num_tokens` is the prompt length after any media
    expansion (defaults to `len(prompt.token_ids)`); a prompt needs room for one new token."""
    ids, s = req.prompt.token_ids, req.sampling
    if not ids:
        raise ValueError(f"request {req.request_id}: prompt.token_ids is empty")
    if s.max_new_tokens < 1:  # SamplingParams checks this too; a request built around it is still refused
        raise ValueError(
            f"request {req.request_id}: sampling.max_new_tokens must be >= 1, got {s.max_new_tokens}"
        )
    if s.n < 1:
        raise ValueError(f"request {req.request_id}: sampling.n must be >= 1, got {s.n}")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"request {req.request_id}: token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    length = len(ids) if num_tokens is None else num_tokens
    if length >= max_context:
        raise ValueError(
            f"request {req.request_id}: prompt has {length} tokens; the model's context is {max_context}"
        )


def error_completions(req: GenerateRequest, message: str, version: int) -> list[Completion]:
    """One error completion per requested sample (at least one), carrying `message`."""
    return [
        Completion(
            request_id=req.request_id,
            index=i,
            token_ids=[],
            logprobs=[],
            finish_reason="error",
            policy_version=version,
            error=message,
        )
        for i in range(max(req.sampling.n, 1))
    ]
