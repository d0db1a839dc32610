"""Wire and config types of yatt-multimodal: reward requests and results, judge and reward specs.

Specs are frozen configs that reject unknown fields; `RewardRequest` and `Reward` are messages that tolerate
them. Media travel as `yatt_rollout.types.MediaRef`, never as pixels.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from yatt_rollout.types import MediaRef

RewardStatus = Literal["ok", "parse_error", "timeout", "error"]
VerdictParser = Literal["yes_no", "score", "json"]
Aggregation = Literal["mean", "majority"]
OnFailure = Literal["zero", "drop", "fail"]


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of typed configuration: immutable, unknown fields are an error. (kw_only is not inherited:
    every subclass states it.)"""


class _Wire(msgspec.Struct, omit_defaults=True):
    """Base of messages: unknown fields are ignored, defaults are not sent."""


class RewardRequest(_Wire, kw_only=True):
    """One response to be scored.

    Producer: a controller after rollout. Consumer: a reward function, a reward model or a judge service.
    `reference` is the expected answer where the task has one; `response_token_ids` lets token-level rewards
    (CAPO, PRMs) map step spans to token positions.
    """

    request_id: str
    prompt: str
    response: str
    reference: str = ""
    media: list[MediaRef] = []
    response_token_ids: list[int] = []
    metadata: dict[str, str] = {}


class Reward(_Wire, kw_only=True):
    """The score of one `RewardRequest`.

    Producer: a reward function or judge. Consumer: the controller (advantages, filters, metrics).
    `status != "ok"` means `score` is not a judgement: the controller applies the configured failure policy and
    counts it, never taking it as a silent zero. `token_scores`, when present, has one entry per response token.
    """

    request_id: str
    score: float
    status: RewardStatus = "ok"
    components: dict[str, float] = {}
    token_scores: list[float] | None = None
    critique: str = ""
    error: str = ""


class JudgeSpec(_Config, kw_only=True):
    """A generative reward model: template, sampling of K judgements, parsing and aggregation.

    Producer: the app's config. Consumer: the GenRM judge, which renders `template_name`@`template_version`,
    samples `num_samples` judgements through a yatt-rollout engine and aggregates them.
    Defaults follow WeChat-YATT's GSM8K recipe: 8 judgements at temperature 0.7, top-p 0.9, up to 512 tokens.
    """

    template_name: str = "verify_yes_no"
    template_version: int = 1
    num_samples: int = 8
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 512
    parser: VerdictParser = "yes_no"
    aggregation: Aggregation = "mean"
    score_range: tuple[float, float] = (0.0, 10.0)  # for the numeric "score" parser
    on_parse_error: OnFailure = "zero"
    on_timeout: OnFailure = "drop"
    timeout_s: float = 120.0
    max_concurrency: int = 64
    dedup: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"JudgeSpec.num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"JudgeSpec.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.timeout_s <= 0:
            raise ValueError(f"JudgeSpec.timeout_s must be > 0, got {self.timeout_s}")
        if self.score_range[0] >= self.score_range[1]:
            raise ValueError(f"JudgeSpec.score_range must be increasing, got {self.score_range}")


class RewardSpec(_Config, kw_only=True):
    """One term of a combined reward: `kind` names a registered reward (e.g. "math_verify", "format", "genrm").

    Producer: the app's config. Consumer: the reward combiner, which sums `weight * score` over terms.
    """

    kind: str
    weight: float = 1.0
    name: str = ""  # the component's name in `Reward.components`; defaults to `kind`
    judge: JudgeSpec | None = None
    options: dict[str, str] = {}
