"""Test doubles, named as such: `ScriptedJudgeEngine` stands in for a judge LLM behind the `Generator` protocol.

It answers each prompt with text from a script (encoded with a `PromptCodec`, `ByteCodec` by default), can
delay or fail chosen prompts, and records every request it receives. It lets verdict parsing, aggregation,
dedup, timeouts and failure policies be tested deterministically; the same judges are also tested through
the real HF engine of yatt-rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from yatt_rollout.types import Completion, GenerateRequest, WeightBucket

from yatt_multimodal.prompt_codecs import ByteCodec, PromptCodec

FAIL = "\x00fail"  # a script answer that makes the double return finish_reason="error" for that request


class ScriptedJudgeEngine:
    """`script(prompt_text, sample_index) -> judgement text` (or `FAIL`); `delay_s(prompt_text)` seconds
    before a prompt's completions stream out (the double's stand-in for a slow judge)."""

    def __init__(
        self,
        script: Callable[[str, int], str],
        *,
        codec: PromptCodec | None = None,
        delay_s: Callable[[str], float] | None = None,
    ):
        self.script, self.codec = script, codec or ByteCodec()
        self.delay_s = delay_s or (lambda _prompt: 0.0)
        self.requests: list[GenerateRequest] = []  # every request received, in order
        self.call_sizes: list[int] = []  # requests per generate/stream call
        self._version = 0

    def prompt_texts(self) -> list[str]:
        return [self.codec.decode(r.prompt.token_ids) for r in self.requests]

    def _complete(self, request: GenerateRequest) -> list[Completion]:
        prompt = self.codec.decode(request.prompt.token_ids)
        out = []
        for index in range(request.sampling.n):
            text = self.script(prompt, index)
            if text == FAIL:
                return [self._error(request, index) for index in range(request.sampling.n)]
            ids = list(text.encode()) if isinstance(self.codec, ByteCodec) else self._encode(text)
            ids = ids[: request.sampling.max_new_tokens]
            out.append(
                Completion(
                    request_id=request.request_id,
                    index=index,
                    token_ids=ids,
                    logprobs=[0.0] * len(ids),
                    finish_reason="stop",
                    policy_version=self._version,
                )
            )
        return out

    def _encode(self, text: str) -> list[int]:
        return list(self.codec.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _error(self, request: GenerateRequest, index: int) -> Completion:
        return Completion(
            request_id=request.request_id,
            index=index,
            token_ids=[],
            logprobs=[],
            finish_reason="error",
            policy_version=self._version,
            error="scripted failure",
        )

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        self.requests.extend(requests)
        self.call_sizes.append(len(requests))
        return [c for r in requests for c in self._complete(r)]

    async def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[Completion]:
        self.requests.extend(requests)
        self.call_sizes.append(len(requests))

        async def one(request: GenerateRequest) -> list[Completion]:
            await asyncio.sleep(self.delay_s(self.codec.decode(request.prompt.token_ids)))
            return self._complete(request)

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            for done in asyncio.as_completed(tasks):
                for completion in await done:
                    yield completion
        finally:  # a consumer that stops early (a timeout) cancels what is still sleeping
            for task in tasks:
                task.cancel()

    def update_weights(self, buckets: Sequence[WeightBucket], version: int) -> None:
        self._version = version

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    @property
    def policy_version(self) -> int:
        return self._version
