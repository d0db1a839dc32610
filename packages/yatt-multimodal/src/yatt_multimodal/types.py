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
    every subclass states it; each restates frozen, which mypy's dataclass view does not inherit.)"""


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


class JudgeSpec(_Config, frozen=True, kw_only=True):
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
    # constrained verdicts: each judgement is exactly one of these texts (e.g. "Verdict: Yes", "Verdict: No"),
    # passed to the engine as `SamplingParams.choices`; each must state a verdict to `parser`. Unset (read it
    # with `or []`): free text; unset, it is left out of the encoding, so older specs keep their bytes
    choices: list[str] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"JudgeSpec.num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"JudgeSpec.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.timeout_s <= 0:
            raise ValueError(f"JudgeSpec.timeout_s must be > 0, got {self.timeout_s}")
        if self.score_range[0] >= self.score_range[1]:
            raise ValueError(f"JudgeSpec.score_range must be increasing, got {self.score_range}")
        if self.choices is not msgspec.UNSET and not all(self.choices):
            raise ValueError(f"JudgeSpec.choices must be non-empty strings, got {self.choices}")


class RewardSpec(_Config, frozen=True, kw_only=True):
    """One term of a combined reward: `kind` names a registered reward (e.g. "math_verify", "format", "genrm").

    Producer: the app's config. Consumer: the reward combiner, which sums `weight * score` over terms.
    """

    kind: str
    weight: float = 1.0
    name: str = ""  # the component's name in `Reward.components`; defaults to `kind`
    judge: JudgeSpec | None = None
    options: dict[str, str] = {}


class MediaLimits(_Config, frozen=True, kw_only=True):
    """What a `MediaRef` may point at before it is decoded: formats, bytes, pixels, and whether remote URLs
    are fetched at all (off by default: a dataset row must not make a trainer reach the network).

    Producer: the app's config. Consumer: `yatt_multimodal.media.load_image`.
    """

    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    min_side: int = 1
    allow_remote: bool = False
    remote_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"MediaLimits.max_bytes must be >= 1, got {self.max_bytes}")
        if self.max_pixels < 1:
            raise ValueError(f"MediaLimits.max_pixels must be >= 1, got {self.max_pixels}")
        if not self.formats:
            raise ValueError("MediaLimits.formats must name at least one image format")


class StepCritique(_Wire, kw_only=True):
    """CAPO's GenPRM output for one response: its steps, where they sit in the tokens, and K wrong-step sets.

    Producer: `yatt_multimodal.genprm.GenPRM`. Consumer: yatt-algos' CAPO voting, which turns
    `wrong_steps` (K sets of 0-based step indices, one per critique) into a per-token penalty via
    `token_spans`. `char_spans[i]` / `token_spans[i]` are half-open `[start, end)` spans of step i in the
    response text / `response_token_ids`. `num_parsed < len(wrong_steps)` never happens: unparsed critiques
    are left out of `wrong_steps` and counted in `num_unparsed`.
    """

    request_id: str
    char_spans: list[tuple[int, int]]
    token_spans: list[tuple[int, int]]
    wrong_steps: list[list[int]]
    status: RewardStatus = "ok"
    num_unparsed: int = 0
    critiques: list[str] = []
    error: str = ""


class RewardMetrics(_Wire, kw_only=True):
    """Counts of one scoring call, for the step's metrics: failures are counted, never silent.

    Producer: a judge or the reward combiner. Consumer: the controller's step report.
    `num_judged` counts judge prompts actually sent (after dedup); `num_judgements` counts sampled verdicts.
    """

    num_requests: int = 0
    num_judged: int = 0
    num_judgements: int = 0
    num_unparsed_judgements: int = 0
    num_parse_error: int = 0
    num_timeout: int = 0
    num_error: int = 0
    num_dropped: int = 0
