"""vLLM's finished request outputs as `Completion`s (`VLLMEngine`): tokens, raw logprobs, finish reason, the
weight versions of its token runs (partial rollouts) and its routed experts (MoE, R3)."""

from __future__ import annotations

from typing import Any

from yatt_rollout.types import Completion, FinishReason, GenerateRequest, RoutedExperts


def completions(req: GenerateRequest, output: Any, version: int) -> list[Completion]:
    """The `Completion`s of `req` from vLLM's finished `RequestOutput`, in sample order; `version`: the
    engine's weight version when the request was admitted (where vLLM labels no token spans)."""
    out = []
    for sample in sorted(output.outputs, key=lambda o: o.index):
        tokens = list(sample.token_ids)
        spans = getattr(sample, "weight_versions", None)  # vLLM's (version label, start, end) of its tokens
        if spans:
            runs = [(int(span.version), span.end - span.start) for span in spans if span.end > span.start]
        else:
            runs = [(version, len(tokens))] if tokens else []
        logprobs = (
            [lp[t].logprob for t, lp in zip(tokens, sample.logprobs, strict=True)] if sample.logprobs else []
        )
        reason: FinishReason = "error"
        if sample.finish_reason in ("stop", "length"):
            reason = "stop" if sample.finish_reason == "stop" else "length"
        out.append(
            Completion(
                request_id=req.request_id,
                index=sample.index,
                token_ids=tokens,
                logprobs=logprobs,
                finish_reason=reason,
                policy_version=runs[0][0] if runs else version,
                error="" if reason != "error" else f"vLLM finished with {sample.finish_reason!r}",
                version_runs=runs,
                routed_experts=_routes(sample, len(req.prompt.token_ids) + len(tokens) - 1),
            )
        )
    return out


def _routes(sample: Any, num_positions: int) -> RoutedExperts | None:
    """vLLM's routed experts of a sample (with `enable_return_routed_experts`) [seq_len, layers, k], cut to the
    positions `RoutedExperts` holds; None when vLLM returned none."""
    ids = getattr(sample, "routed_experts", None)
    if ids is None:
        return None
    import torch

    from yatt_rollout.routing import encode_routes

    return encode_routes(torch.as_tensor(ids)[:num_positions])
