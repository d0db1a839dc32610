"""Wire and config types of yatt-rollout: requests, completions, media references and weight buckets.

`SamplingParams` is a frozen config that rejects unknown fields; the rest are messages that tolerate them.
Raw pixels and bulk tensors never travel inline: media go by `MediaRef`, weights by one flat buffer in a
`WeightBucket` that msgpack decodes zero-copy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol, get_args, runtime_checkable

import msgspec
from msgspec import UNSET, UnsetType

FinishReason = Literal["stop", "length", "error"]


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of typed configuration: immutable, unknown fields are an error. (kw_only is not inherited:
    every subclass states it.)"""


class _Wire(msgspec.Struct, omit_defaults=True):
    """Base of messages: unknown fields are ignored, defaults are not sent."""


class SamplingParams(_Config, frozen=True, kw_only=True):
    """How to sample. `top_k = 0` and `top_p = 1.0` disable those filters; `seed` makes a request reproducible.

    `choices`: the completion must be exactly one of these strings, then eos (constrained decoding; e.g. a
    judge's verdict). `allowed_token_ids`: every sampled token is one of these ids (include eos to allow
    stopping). At most one of the two. Both are omitted from the encoding while unset (UNSET, read them
    with `or []`), so requests that do not use them keep their bytes and decode in older readers.

    Producer: the app's config, a judge spec. Consumer: every `Generator`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = []
    seed: int | None = None
    logprobs: bool = True
    choices: list[str] | UnsetType = UNSET
    allowed_token_ids: list[int] | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        self._check_constraints()

    def _check_constraints(self) -> None:
        choices, allowed = self.choices, self.allowed_token_ids
        if choices is not UNSET and allowed is not UNSET:
            raise ValueError("SamplingParams.choices and allowed_token_ids cannot both be set")
        if choices is not UNSET:
            if not choices:
                raise ValueError(
                    "SamplingParams.choices must not be empty (leave it unset for no constraint)"
                )
            empty = next((i for i, c in enumerate(choices) if not c), None)
            if empty is not None:
                raise ValueError(f"SamplingParams.choices[{empty}] is an empty string")
        if allowed is not UNSET:
            if not allowed:
                raise ValueError(
                    "SamplingParams.allowed_token_ids must not be empty (leave it unset for no constraint)"
                )
            if min(allowed) < 0:
                raise ValueError(f"SamplingParams.allowed_token_ids has a negative id {min(allowed)}")


class MediaRef(_Wire, kw_only=True):
    """An image or video by reference: a file path, `file://` or `data:` URI. Pixels are loaded where used.

    Producer: the dataset reader. Consumer: the VLM rollout engine and the multimodal judges.
    """

    kind: Literal["image", "video"]
    uri: str
    sha256: str = ""  # optional integrity check of the referenced bytes


class Prompt(_Wire, kw_only=True):
    """A tokenized prompt, with the media its placeholder tokens refer to.

    Producer: the controller's data pipeline (chat template + tokenizer). Consumer: `Generator`.
    """

    token_ids: list[int]
    media: list[MediaRef] = []
    text: str = ""  # the rendered prompt, for logs and judges; engines read token_ids


class GenerateRequest(_Wire, kw_only=True):
    """One prompt to be completed `sampling.n` times.

    Producer: a controller (or a judge). Consumer: a `Generator` replica, possibly across a process boundary.
    """

    request_id: str
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()


class RoutedExperts(_Wire, kw_only=True):
    """The experts a mixture-of-experts router chose, for rollout routing replay (R3, arXiv 2510.23027).

    `data` holds ids [num_positions, num_layers, top_k] in C order, one byte each (`dtype` "uint8", fewer than
    256 experts) or two ("int16"). Positions are the sequence's prompt tokens then its generated tokens but the
    last (the engine never runs that one through the model): num_positions = len(prompt) + len(token_ids) - 1,
    position i being the forward of token i. `yatt_rollout.routing` converts to and from tensors.

    Producer: a `Generator` over an MoE model. Consumer: the learner's routing replay
    (`yatt_algos.learner.routing`).
    """

    num_layers: int
    top_k: int
    dtype: Literal["uint8", "int16"] = "uint8"
    data: bytes = b""

    @property
    def num_positions(self) -> int:
        itemsize = 1 if self.dtype == "uint8" else 2
        return len(self.data) // (itemsize * self.num_layers * self.top_k)


class Completion(_Wire, kw_only=True):
    """One sampled completion. `logprobs[i]` is the sampling-time logprob of `token_ids[i]`.

    `version_runs` is the policy version of every token as runs `(version, n_tokens)` in token order, their
    counts summing to `len(token_ids)`; more than one run when a partial rollout spanned a weight update.
    `policy_version` is the oldest (first) run's version, the one a staleness bound is checked against.
    Empty (old producers, error completions): every token is `policy_version`'s; read it with `runs()`.

    Producer: a `Generator`. Consumer: the controller (reward, advantages, training) which checks
    `policy_version` against the version it expects. `finish_reason == "error"` carries `error` and no tokens.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    error: str = ""
    version_runs: list[tuple[int, int]] = []  # appended: omitted while empty, so old bytes are unchanged
    # appended: the MoE router's choices per position and layer (`RoutedExperts`); None for a dense model or
    # an engine that does not record them
    routed_experts: RoutedExperts | None = None

    def runs(self) -> list[tuple[int, int]]:
        """`version_runs`, or one run of `policy_version` over every token when the producer sent none."""
        if self.version_runs:
            return [(run[0], run[1]) for run in self.version_runs]
        return [(self.policy_version, len(self.token_ids))] if self.token_ids else []

    def token_versions(self) -> list[int]:
        """The policy version of each token, one per `token_ids` entry."""
        return [version for version, count in self.runs() for _ in range(count)]


class WeightBucket(_Wire, kw_only=True):
    """Named tensors packed back to back in one flat buffer, for weight sync. One dtype per bucket.

    Producer: the learner's `export_weights` (HF naming). Consumer: `Generator.update_weights`.
    Tensor i occupies `data[offsets[i] : offsets[i] + nbytes(shapes[i], dtype)]`; offsets are aligned.
    """

    names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32", "bfloat16"
    data: memoryview
    version: int = 0


@runtime_checkable
class Generator(Protocol):
    """What every rollout engine (HF, vLLM, a remote replica) provides.

    `generate` is the batch call; `stream` yields completions as they finish (async pipelines, partial
    colocation). A request that fails returns completions with `finish_reason="error"`; others are unaffected.
    """

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]: ...

    def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[Completion]: ...

    def update_weights(self, buckets: Sequence[WeightBucket], version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    @property
    def policy_version(self) -> int: ...


class ReplicaLoad(_Wire, kw_only=True):
    """The load of one engine replica as the load-balancing client sees it. Work is counted in tokens:
    `n * (prompt tokens + max_new_tokens)` per request, the bound the replica may have to compute.

    Producer: `ReplicaClient.load()`. Consumer: the controller's metrics and the placement re-planner.
    """

    replica: int
    outstanding_requests: int
    outstanding_tokens: int
    completed_requests: int = 0
    generated_tokens: int = 0
    failed_requests: int = 0


# ---- multi-turn environments and tools (yatt_rollout.env, .agent, .sandbox, .tools) -------------------------

ToolStatus = Literal[
    "ok",
    "timeout",
    "memory",
    "processes",
    "crash",
    "output_limit",
    "network",
    "malformed",
    "unknown_tool",
    "error",
]
# every kind of failed tool call, in a fixed order (metrics keys must agree across controllers)
TOOL_ERROR_KINDS: tuple[str, ...] = tuple(status for status in get_args(ToolStatus) if status != "ok")
StopReason = Literal["done", "max_turns", "max_length", "error"]


class Message(_Wire, kw_only=True):
    """One chat message; `role` is what the chat template knows (system, user, assistant, tool)."""

    role: str
    content: str


class ToolSpec(_Wire, kw_only=True):
    """A tool as a JSON-schema function, the shape chat templates render (`{"type": "function", ...}`).

    Producer: a tool (`yatt_rollout.tools`). Consumer: the prompt renderer and the environment's dispatch.
    """

    name: str
    description: str
    parameters: dict = {}  # a JSON schema of the arguments object


class ToolCall(_Wire, kw_only=True):
    """One parsed `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of the model's text."""

    name: str
    arguments: dict = {}


class ToolResult(_Wire, kw_only=True):
    """What a tool returns; `status != "ok"` is a failed call, shown to the model as an error observation."""

    status: ToolStatus
    output: str


class SandboxResult(_Wire, kw_only=True):
    """One sandboxed Python run. `network_isolation` says how the network was cut: "namespace" (a fresh,
    empty network namespace) or "patched" (socket creation blocked in the child's Python)."""

    status: ToolStatus
    stdout: str
    stderr: str
    exit_code: int
    wall_s: float
    network_isolation: str = ""


class Observation(_Wire, kw_only=True):
    """What an environment shows the model: messages appended to the conversation (a reset's are the
    prompt; a step's are tool or user turns, tokenised as a delta)."""

    messages: list[Message] = []


class Action(_Wire, kw_only=True):
    """The model's turn as the environment sees it: the decoded text, its parsed tool calls, and the
    problems of calls that did not parse (each is one malformed call)."""

    text: str
    tool_calls: list[ToolCall] = []
    malformed: list[str] = []


class StepResult(_Wire, kw_only=True):
    """An environment's answer to one action; `tool_errors` lists the kind of every failed call."""

    observation: Observation
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: list[str] = []


class Trajectory(_Wire, kw_only=True):
    """One multi-turn episode, token-in/token-out. Field names shared with `Completion` mean the same.

    `token_ids` is everything after the prompt: model turns and environment replies, exactly as sampled and
    tokenised (never re-tokenised). `response_mask[i]` is 1 on model-generated tokens and 0 on environment
    tokens; `logprobs[i]` is the sampling-time logprob of a model token and 0.0 on environment tokens.
    Producer: `yatt_rollout.agent.AgentDriver`. Consumer: the training controller.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    response_mask: list[int]
    finish_reason: FinishReason
    policy_version: int
    stop_reason: StopReason = "done"
    num_turns: int = 0
    reward: float = 0.0  # the environment's rewards summed over the episode
    tool_calls: int = 0
    tool_errors: dict[str, int] = {}
    error: str = ""
