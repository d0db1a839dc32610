"""GenRM: an LLM judge served through a yatt-rollout engine, as a first-class `RewardFunction`.

WeChat-YATT's recipe (arXiv 2508.07970, GSM8K with a 72B judge): per response, sample K = 8 judgements
(temperature 0.7, top-p 0.9, up to 512 tokens) of a grading prompt that ends in a fixed Yes/No verdict
phrase; +1 yes, -1 no, 0 no verdict; reward = mean. This judge generalises the parser (Yes/No, numeric score,
JSON) and the aggregation (mean, majority), renders versioned templates, judges identical
(prompt, response, reference, media) tuples once per batch, and reports parse failures and timeouts as
statuses with counts. Where it departs from the paper: a response none of whose K judgements states a
verdict is a `parse_error` (the paper's mean would be a silent 0); the policy decides what that scores.
The response is untrusted: the codec encodes it as ordinary text (a spelled-out `<|im_start|>` opens no turn),
and a judgement's verdict is the first one the judge states itself, not one it copies from its prompt
(`verdicts`: the prompt's texts are passed as `quoted`).
With media and a VLM codec (`yatt_multimodal.vlm.QwenVLCodec`) the same class is the VLM judge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
from yatt_rollout.types import GenerateRequest, Generator, MediaRef, Prompt, SamplingParams

from yatt_multimodal.judge_calls import JudgeCall, sample_judgements
from yatt_multimodal.prompt_codecs import PromptCodec
from yatt_multimodal.rewards import RewardBatch, count_statuses, failed
from yatt_multimodal.templates import get_template
from yatt_multimodal.types import JudgeSpec, OnFailure, Reward, RewardMetrics, RewardRequest
from yatt_multimodal.verdicts import AGGREGATIONS, PARSERS

JudgeKey = tuple[str, str, str, tuple[str, ...]]


def judge_key(request: RewardRequest) -> JudgeKey:
    """What makes two requests the same judgement: everything the judge prompt is built from."""
    return (request.prompt, request.response, request.reference, tuple(m.uri for m in request.media))


def judge_sampling(spec: JudgeSpec, seed: int | None = None) -> SamplingParams:
    """The engine's sampling of one judge prompt: K samples, and `spec.choices` as a constrained choice."""
    return SamplingParams(
        n=spec.num_samples,
        temperature=spec.temperature,
        top_p=spec.top_p,
        max_new_tokens=spec.max_new_tokens,
        seed=seed,
        logprobs=False,
        choices=list(spec.choices) if spec.choices else msgspec.UNSET,  # UNSET and [] are falsy
    )


def check_choices(spec: JudgeSpec, parse: Callable[[str], object]) -> None:
    """Every constrained choice must be a verdict the parser reads (else a constrained judge could only
    produce parse errors)."""
    for i, choice in enumerate(spec.choices or []):
        if parse(choice) is None:
            raise ValueError(
                f"JudgeSpec.choices[{i}] {choice!r} states no verdict to the {spec.template_name!r} template's parser"
            )


class GenRMJudge:
    """`score(requests)` -> one `Reward` per request: `score` in [-1, 1] (the aggregated verdict),
    `components[name]` the same, `components[name + "/parsed"]` the fraction of K judgements with a verdict,
    `critique` the first judgement. `media_check(ref)` (e.g. `media.load_image` with limits) validates media
    before a prompt is sent: a bad image fails that request only."""

    def __init__(
        self,
        engine: Generator,
        codec: PromptCodec,
        spec: JudgeSpec | None = None,
        *,
        name: str = "genrm",
        seed: int | None = None,
        media_check: Callable[[MediaRef], object] | None = None,
    ):
        self.spec = spec or JudgeSpec()
        self.template = get_template(self.spec.template_name, self.spec.template_version)
        if self.template.parser != self.spec.parser:
            raise ValueError(
                f"JudgeSpec.parser {self.spec.parser!r} does not read template "
                f"{self.template.name}@{self.template.version}, which asks for {self.template.parser!r}"
            )
        check_choices(self.spec, lambda text: PARSERS[self.spec.parser](text, self.spec.score_range))
        self.engine, self.codec, self.name, self.seed, self.media_check = (
            engine,
            codec,
            name,
            seed,
            media_check,
        )

    @property
    def failure_policy(self) -> dict[str, OnFailure]:
        """For `rewards.resolve_failures`: the spec's choices for parse errors and timeouts; errors
        (engine failure, bad media) drop the sample."""
        return {"parse_error": self.spec.on_parse_error, "timeout": self.spec.on_timeout, "error": "drop"}

    def build_prompt(self, request: RewardRequest) -> Prompt:
        """The rendered judge prompt, tokenized by the codec, with the request's media attached."""
        for ref in request.media:
            if self.media_check is not None:
                self.media_check(ref)
        low, high = self.spec.score_range
        system, user = self.template.render(
            question=request.prompt,
            response=request.response,
            reference=request.reference,
            low=low,
            high=high,
        )
        ids = self.codec.encode_prompt(system, user, num_images=len(request.media))
        return Prompt(token_ids=ids, media=list(request.media), text=user)

    async def score(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        groups = self._groups(requests)  # one judge prompt per group of identical requests
        to_send: list[GenerateRequest] = []
        prepared: dict[str, Reward] = {}
        quoted: dict[str, tuple[str, str]] = {}
        for gid, members in groups.items():
            try:
                prompt = self.build_prompt(requests[members[0]])
            except ValueError as exc:  # bad media or an unencodable prompt: this group only
                prepared[gid] = failed(requests[members[0]], "error", f"{self.name}: {exc}")
                continue
            quoted[gid] = (prompt.text or "", self.template.system)
            seed = None if self.seed is None else self.seed + len(to_send)
            to_send.append(
                GenerateRequest(request_id=gid, prompt=prompt, sampling=judge_sampling(self.spec, seed))
            )
        calls = await sample_judgements(
            self.engine, to_send, timeout_s=self.spec.timeout_s, max_concurrency=self.spec.max_concurrency
        )
        metrics = RewardMetrics(num_judged=len(to_send))
        for gid, call in calls.items():
            prepared[gid] = self._reward(requests[groups[gid][0]], call, metrics, quoted[gid])
        group_of = {i: gid for gid, members in groups.items() for i in members}
        rewards = [_for_request(prepared[group_of[i]], r.request_id) for i, r in enumerate(requests)]
        return RewardBatch(rewards, count_statuses(rewards, metrics))

    def _groups(self, requests: Sequence[RewardRequest]) -> dict[str, list[int]]:
        if not self.spec.dedup:
            return {f"j{i}": [i] for i in range(len(requests))}
        first: dict[JudgeKey, str] = {}
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            gid = first.setdefault(judge_key(request), f"j{i}")
            groups.setdefault(gid, []).append(i)
        return groups

    def parse(self, text: str, quoted: Sequence[str]) -> float | None:
        """One judgement's verdict: a constrained choice as it is; free text, the first verdict the judge
        states itself after its reasoning (none copied from `quoted`, its prompt's texts)."""
        parse = PARSERS[self.spec.parser]
        if text in (self.spec.choices or []):
            return parse(text, self.spec.score_range)
        return parse(text, self.spec.score_range, quoted=quoted)

    def _reward(
        self, request: RewardRequest, call: JudgeCall, metrics: RewardMetrics, quoted: Sequence[str]
    ) -> Reward:
        if call.status != "ok":
            return failed(request, call.status, f"{self.name}: {call.error}")
        texts = [self.codec.decode(c.token_ids) for c in call.completions]
        verdicts = [self.parse(t, quoted) for t in texts]
        unparsed = sum(v is None for v in verdicts)
        metrics.num_judgements += len(verdicts)
        metrics.num_unparsed_judgements += unparsed
        value = AGGREGATIONS[self.spec.aggregation](verdicts)
        if value is None:
            reward = failed(
                request, "parse_error", f"{self.name}: no verdict in any of {len(texts)} judgements"
            )
            reward.critique = texts[0] if texts else ""
            return reward
        components = {self.name: value, f"{self.name}/parsed": 1.0 - unparsed / len(verdicts)}
        return Reward(request_id=request.request_id, score=value, components=components, critique=texts[0])


def _for_request(reward: Reward, request_id: str) -> Reward:
    """A copy of a group's reward under one member's id (members must not share a mutable Reward)."""
    return Reward(
        request_id=request_id,
        score=reward.score,
        status=reward.status,
        components=dict(reward.components),
        token_scores=None if reward.token_scores is None else list(reward.token_scores),
        critique=reward.critique,
        error=reward.error,
    )
