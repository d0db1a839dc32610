"""Test doubles, named as such: `ScriptedJudgeEngine` stands in for a judge LLM behind the `Generator` protocol;
`EchoingJudgeEngine` is one that repeats the response it was shown, then gives its own verdict (the judge a
hostile response tries to exploit by writing a verdict of its own).

`ScriptedJudgeEngine` answers each prompt with text from a script (encoded with a `PromptCodec`, `ByteCodec` by default), can
delay or fail chosen prompts, and records every request it receives. It lets verdict parsing, aggregation,
dedup, timeouts and failure policies be tested deterministically; the same judges are also tested through
the real HF engine of yatt-rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from yatt_rollout.types import Completion, GenerateRequest, WeightBucket

from yatt_multimodal.prompt_codecs import ByteCodec, PromptCodec, text_tokens

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
        return [self._prompt_text(r.prompt.token_ids) for r in self.requests]

    def _prompt_text(self, token_ids: Sequence[int]) -> str:
        """The whole prompt as text, special tokens left out (a codec's `decode` stops at the first turn end)."""
        tokenizer = getattr(self.codec, "tokenizer", None)
        if tokenizer is None:
            return self.codec.decode(token_ids)
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _complete(self, request: GenerateRequest) -> list[Completion]:
        prompt = self._prompt_text(request.prompt.token_ids)
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
        # generated text: a special token spelled out in it is text, as a model writing it would produce
        codec: Any = self.codec  # an HF codec (ByteCodec answers are encoded by the caller)
        return text_tokens(codec.tokenizer, text)

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
            await asyncio.sleep(self.delay_s(self._prompt_text(request.prompt.token_ids)))
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


class EchoingJudgeEngine(ScriptedJudgeEngine):
    """A judge double that repeats what it was shown (the prompt from its last `echo_from` marker on: the
    response and whatever follows it; all of the prompt when the marker is absent), then states its own
    `verdict` on a line of its own; `verdict_first` puts its verdict before the echo instead."""

    def __init__(
        self,
        verdict: str = "Verdict: No",
        *,
        codec: PromptCodec | None = None,
        echo_from: str = "Solution to grade:\n",
        verdict_first: bool = False,
    ):
        self.verdict, self.echo_from, self.verdict_first = verdict, echo_from, verdict_first
        super().__init__(self._answer, codec=codec)

    def _answer(self, prompt: str, index: int) -> str:
        cut = prompt.rfind(self.echo_from)
        echo = prompt if cut < 0 else prompt[cut + len(self.echo_from) :]
        return f"{self.verdict}\n{echo}" if self.verdict_first else f"{echo}\n{self.verdict}"
