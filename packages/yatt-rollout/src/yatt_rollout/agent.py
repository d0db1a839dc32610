"""The multi-turn driver: episodes of model turns and environment replies on one token sequence.

Episodes batched across turns. `AgentDriver.run` advances every episode on its own thread: when an
episode's turn completes, its environment step (tool calls, possibly slow) runs there and its next turn is
submitted at once, while the engine keeps decoding the other episodes' turns (HFEngine joins a turn submitted
mid-batch into the running batch; vLLM admits it into its running batch), so a slow tool or a long turn holds
back only its own episode. Threads rather than coroutines over `engine.stream`: each episode blocks in the
engine's thread-safe `generate`, and vLLM's `stream` would wait on asyncio's default executor (a few
threads on a small machine), which would run only that many episodes at a time. `continuous=False` keeps
the turn-synchronous driver (one `generate` per turn over every live episode), and an engine without
`stream` (a test double) gets it too.

Token-in/token-out. Each turn appends the episode's generated ids as they came, then the environment's
reply tokenised on its own as a delta: the reply messages
are rendered by the chat template after a fixed stand-in conversation and the text after the stand-in's
end-of-turn token is tokenised once. Earlier turns are never re-rendered or re-tokenised, so a thinking
template that strips earlier `<think>` blocks cannot change what the model saw, and the training sequence is
exactly the sampled one.

A turn that ended without the end-of-turn token (its `max_new_tokens` ran out) is closed by the driver: the
eos id goes before the reply, as an environment token. The response mask is 1 exactly on generated tokens;
rollout logprobs are the engine's on those and 0.0 on environment tokens. An episode stops when the
environment says done, after `max_turns` model turns, or when the next turn or reply would pass
`max_total_tokens` (prompt included; counted as truncated, `finish_reason="length"`).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from yatt_rollout.env import (
    ENVIRONMENTS,
    Environment,
    parse_tool_calls,
    render_tool_call,
    with_tools,
)
from yatt_rollout.types import (
    TOOL_ERROR_KINDS,
    Action,
    Completion,
    FinishReason,
    GenerateRequest,
    Message,
    Prompt,
    StopReason,
    ToolCall,
    ToolSpec,
    Trajectory,
)

# episodes advancing at once (more wait for a thread; each mostly waits on the engine)
MAX_EPISODE_THREADS = 1024

# the stand-in conversation after which an environment reply is rendered (its content never reaches a model)
_STAND_IN = [
    Message(role="system", content="S"),
    Message(role="user", content="U"),
    Message(role="assistant", content="A"),
]


def _mark(i: int) -> str:
    """A placeholder for message i's content in a rendered template (private-use characters: no text has it)."""
    return f"\ue000yatt-turn-{i}\ue001"


ChatMessage = Message | Mapping[str, Any]  # a Message, or a chat dict (TRL's: role, content, tool_calls)


def _doc(i: int, message: ChatMessage) -> dict[str, Any]:
    """Message i as the template's dict, its content replaced by `_mark(i)`; an assistant's `tool_calls`
    (TRL's / OpenAI's `{"type": "function", "function": {"name", "arguments"}}`) kept for the template."""
    if isinstance(message, Message):
        return {"role": message.role, "content": _mark(i)}
    # an empty content stays empty: templates test it (Qwen's writes no newline before the tool calls then)
    doc = {"role": message["role"], "content": _mark(i) if message.get("content") else ""}
    if message.get("tool_calls"):
        doc["tool_calls"] = list(message["tool_calls"])
    return doc


def _call(call: Mapping[str, Any]) -> ToolCall:
    """A TRL/OpenAI tool call (`{"type": "function", "function": {...}}` or the function) as a ToolCall."""
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    return ToolCall(
        name=fn["name"], arguments=json.loads(arguments) if isinstance(arguments, str) else arguments
    )


def _content(message: ChatMessage) -> str:
    return message.content if isinstance(message, Message) else str(message.get("content") or "")


def _role(message: ChatMessage) -> str:
    return message.role if isinstance(message, Message) else str(message["role"])


class TurnCodec:
    """Chat-template rendering for one tokenizer: a prompt from messages (and tools), an environment reply
    as a token delta, and a whole conversation with its assistant turns marked (the multi-turn SFT layout).
    Tools go through the template's own `tools` support where it has one (`apply_chat_template(...,
    tools=...)`, as Qwen2.5's and the tiny tokenizer's), else as the Hermes block in the system message."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token is None:
            raise ValueError("TurnCodec: the tokenizer has no eos token (the end of a chat turn)")
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.native_calls = "tool_calls" in (tokenizer.chat_template or "")

    def _render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], generation: bool) -> str:
        """The template's text with each message's content replaced by a placeholder (`_mark(i)`)."""
        docs, kwargs = with_tools(self.tok, [_doc(i, m) for i, m in enumerate(messages)], tools)
        return self.tok.apply_chat_template(docs, add_generation_prompt=generation, tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _fill(self, rendered: str, messages: Sequence[ChatMessage]) -> list[int]:
        """`rendered`'s ids, each placeholder replaced by its message's content as plain text: a special token
        spelled in a message (a tool's output, a dataset prompt) never becomes a control token, so it cannot
        close its turn or open another role's; the template's own markup keeps its special tokens."""
        ids: list[int] = []
        for i, message in enumerate(messages):
            count = rendered.count(_mark(i))
            if count > 1 or (count == 0 and _content(message)):
                raise ValueError(
                    f"chat template: message {i} ({_role(message)}) is not rendered exactly once"
                )
            if count == 0:  # an empty content the template leaves out (an assistant turn of tool calls only)
                continue
            before, rendered = rendered.split(_mark(i))
            ids += self.encode(before)
            ids += self.tok(_content(message), add_special_tokens=False, split_special_tokens=True)[
                "input_ids"
            ]
        return ids + self.encode(rendered)

    def prompt_ids(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """The prompt of an episode: its messages with the assistant turn opened."""
        return self._fill(self._render(messages, tools, generation=True), messages)

    def _after_stand_in(self, messages: Sequence[ChatMessage], generation: bool) -> list[int]:
        """The tokens the template renders for `messages` after the stand-in conversation's last eos."""
        eos = self.tok.eos_token
        before = self._render(_STAND_IN, (), generation=False)
        after = self._render([*_STAND_IN, *messages], (), generation=generation)
        cut = before.rfind(eos) + len(eos)
        if cut < len(eos) or after[:cut] != before[:cut]:
            raise ValueError("chat template: a reply changes how the conversation before it renders")
        # the stand-in's placeholders lie before the cut: the reply's are renumbered from 0
        tail = after[cut:]
        for i in range(len(messages)):
            tail = tail.replace(_mark(len(_STAND_IN) + i), _mark(i))
        return self._fill(tail, messages)

    def reply_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The tokens that follow a model turn's eos: the reply messages, then the next assistant turn
        opened. Raises ValueError when the template renders the stand-in differently with the reply."""
        return self._after_stand_in(messages, generation=True)

    def assistant_ids(self, message: ChatMessage) -> list[int]:
        """One assistant turn's own tokens as the model writes them after the opened turn: its content and
        tool calls through the eos that ends it (what the template puts after the eos is not the model's).
        A template that does not render `tool_calls` gets them as Hermes blocks in the content."""
        if not isinstance(message, Message) and message.get("tool_calls") and not self.native_calls:
            blocks = [render_tool_call(_call(c)) for c in message["tool_calls"]]
            message = {
                "role": "assistant",
                "content": "\n".join([*filter(None, [message.get("content")]), *blocks]),
            }
        opened = self._after_stand_in([Message(role="user", content="U")], generation=True)
        whole = self._after_stand_in([Message(role="user", content="U"), message], generation=False)
        if whole[: len(opened)] != opened or self.eos_id not in whole[len(opened) :]:
            raise ValueError(
                "chat template: an assistant turn does not follow its opened turn and end with eos"
            )
        own = whole[len(opened) :]
        return own[: own.index(self.eos_id) + 1]

    def conversation_ids(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()
    ) -> tuple[list[int], list[int]]:
        """(ids, mask) of a whole conversation laid out exactly as an episode is: the prompt (the messages
        before the first assistant turn, with `tools`), each assistant turn (`assistant_ids`, mask 1), and the
        messages between turns as a reply delta (`reply_ids`, mask 0). Messages after the last assistant turn
        are no target and are left out. ValueError when there is no assistant turn."""
        turns = [i for i, m in enumerate(messages) if _role(m) == "assistant"]
        if not turns:
            raise ValueError("conversation has no assistant message (nothing to learn)")
        ids = self.prompt_ids(messages[: turns[0]], tools)
        mask = [0] * len(ids)
        for k, i in enumerate(turns):
            own = self.assistant_ids(messages[i])
            ids, mask = ids + own, mask + [1] * len(own)
            if k + 1 < len(turns):
                between = messages[i + 1 : turns[k + 1]]
                if not between:
                    raise ValueError(f"messages {i} and {i + 1}: two assistant turns with nothing between")
                reply = self.reply_ids(between)
                ids, mask = ids + reply, mask + [0] * len(reply)
        return ids, mask


@dataclass
class _Episode:
    request: GenerateRequest
    index: int
    env: Environment
    ids: list[int]  # prompt + response so far
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    version: int | None = None
    stop: StopReason | Literal[""] = ""  # "" while active
    error: str = ""


class AgentDriver:
    """Runs episodes of `env` (a registered name or a factory) against `engine` (any `Generator`): each
    episode on its own (`continuous`, with an engine that has `stream`), else turn by turn over all."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        env: str | Callable[[], Environment],
        *,
        max_turns: int,
        max_total_tokens: int,
        continuous: bool = True,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {max_total_tokens}")
        if isinstance(env, str) and env not in ENVIRONMENTS:
            raise ValueError(f"unknown environment {env!r}; registered: {sorted(ENVIRONMENTS)}")
        self.engine, self.codec = engine, TurnCodec(tokenizer)
        self.factory = ENVIRONMENTS[env] if isinstance(env, str) else env
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        # episodes advance on their own threads only where the engine is a real one (its `generate` safe to
        # call from many threads, as HFEngine's and VLLMEngine's are)
        self.continuous = continuous and hasattr(engine, "stream")
        self._codec_lock = threading.Lock()  # one tokenizer for every episode thread

    def run(self, requests: Sequence[GenerateRequest], rows: Sequence[Mapping[str, Any]]) -> list[Trajectory]:
        """`sampling.n` episodes per request, each with its own environment reset on the request's row.
        A request's `prompt.token_ids` is the prompt; empty, the reset observation (and the environment's
        tools) rendered by the chat template is. Trajectories come in request order, then sample index."""
        episodes = [ep for req, row in zip(requests, rows, strict=True) for ep in self._start(req, row)]
        if self.continuous:
            self._run_each(episodes)
        else:
            self._run_turns(episodes)
        return [self._trajectory(ep) for ep in episodes]

    def _run_turns(self, episodes: list[_Episode]) -> None:
        """Turn-synchronous: one `generate` per turn over every live episode."""
        for turn in range(self.max_turns):
            active = [ep for ep in episodes if not ep.stop and self._has_room(ep)]
            if not active:
                break
            completions = self.engine.generate([self._turn_request(ep, turn) for ep in active])
            for ep, completion in zip(active, completions, strict=True):
                self._advance(ep, completion, last_turn=turn == self.max_turns - 1)

    def _run_each(self, episodes: list[_Episode]) -> None:
        """Every episode on its own thread: a turn, its environment step, the next turn at once."""
        live = [ep for ep in episodes if not ep.stop]
        if not live:
            return
        threads = min(len(live), MAX_EPISODE_THREADS)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="yatt-episode") as pool:
            list(pool.map(self._episode, live))

    def _episode(self, ep: _Episode) -> None:
        try:
            for turn in range(self.max_turns):
                if not self._has_room(ep):
                    return
                (completion,) = self.engine.generate([self._turn_request(ep, turn)])
                self._advance(ep, completion, last_turn=turn == self.max_turns - 1)
                if ep.stop:
                    return
        except Exception as err:  # an engine call that raised (not a failed request) ends only this episode
            ep.stop, ep.error = "error", f"episode failed: {type(err).__name__}: {err}"

    def _start(self, req: GenerateRequest, row: Mapping[str, Any]) -> list[_Episode]:
        out = []
        for index in range(req.sampling.n):
            env = self.factory()
            observation = env.reset(row)
            ids = list(req.prompt.token_ids) or self.codec.prompt_ids(observation.messages, env.tools)
            ep = _Episode(request=req, index=index, env=env, ids=ids, prompt_len=len(ids))
            if len(ids) >= self.max_total_tokens:  # fails alone, as a bad request does in an engine
                ep.stop = "error"
                ep.error = (
                    f"request {req.request_id}: prompt has {len(ids)} tokens, "
                    f"max_total_tokens is {self.max_total_tokens}"
                )
            out.append(ep)
        return out

    def _has_room(self, ep: _Episode) -> bool:
        if len(ep.ids) >= self.max_total_tokens:  # not even one new token fits
            ep.stop = "max_length"
        return not ep.stop

    def _turn_request(self, ep: _Episode, turn: int) -> GenerateRequest:
        """One sample of the episode's next turn, its budget cut to the room left; a seeded request gives
        every (sample, turn) its own seed."""
        s = ep.request.sampling
        seed = None if s.seed is None else s.seed + ep.index * 100_003 + turn * 1_000_033
        budget = min(s.max_new_tokens, self.max_total_tokens - len(ep.ids))
        sampling = msgspec.structs.replace(s, n=1, max_new_tokens=budget, seed=seed)
        return GenerateRequest(
            request_id=f"{ep.request.request_id}/{ep.index}/t{turn}",
            prompt=Prompt(token_ids=list(ep.ids)),
            sampling=sampling,
        )

    def _advance(self, ep: _Episode, c: Completion, *, last_turn: bool) -> None:
        """Append the turn's tokens, let the environment answer, and append its reply (or stop)."""
        if c.finish_reason == "error":
            ep.stop, ep.error = "error", c.error
            return
        ep.ids += c.token_ids
        ep.mask += [1] * len(c.token_ids)
        ep.logprobs += list(c.logprobs) if c.logprobs else [0.0] * len(c.token_ids)
        ep.turns += 1
        ep.version = c.policy_version if ep.version is None else min(ep.version, c.policy_version)
        cut_off = len(ep.ids) >= self.max_total_tokens  # the turn ran into the length limit
        with self._codec_lock:
            text = self.codec.tok.decode(c.token_ids, skip_special_tokens=True)
        calls, malformed = parse_tool_calls(text)
        try:
            result = ep.env.step(Action(text=text, tool_calls=calls, malformed=malformed))  # on no lock
            ends = result.done or last_turn or cut_off
            with self._codec_lock:
                reply = [] if ends else self.codec.reply_ids(result.observation.messages)
        except Exception as err:  # an environment bug ends its own episode, never the rollout
            ep.stop, ep.error = "error", f"environment step failed: {type(err).__name__}: {err}"
            return
        ep.reward += result.reward
        ep.tool_calls += result.tool_calls
        ep.tool_errors.update(result.tool_errors)
        if ends:  # a cut-off turn is truncated even when the environment takes it as the answer
            ep.stop = "max_length" if cut_off else "done" if result.done else "max_turns"
            return
        if c.token_ids[-1] != self.codec.eos_id:  # the turn ran out of tokens: close it for the template
            reply = [self.codec.eos_id, *reply]
        if len(ep.ids) + len(reply) >= self.max_total_tokens:  # no room for the reply and one more token
            ep.stop = "max_length"
            return
        ep.ids += reply
        ep.mask += [0] * len(reply)
        ep.logprobs += [0.0] * len(reply)

    def _trajectory(self, ep: _Episode) -> Trajectory:
        stop = ep.stop or "max_turns"
        finish: FinishReason = "length" if stop == "max_length" else "error" if stop == "error" else "stop"
        return Trajectory(
            request_id=ep.request.request_id,
            index=ep.index,
            token_ids=ep.ids[ep.prompt_len :],
            logprobs=ep.logprobs,
            response_mask=ep.mask,
            finish_reason=finish,
            policy_version=ep.version
            if ep.version is not None
            else getattr(self.engine, "policy_version", 0),
            stop_reason=stop,
            num_turns=ep.turns,
            reward=ep.reward,
            tool_calls=ep.tool_calls,
            tool_errors=dict(ep.tool_errors),
            error=ep.error,
        )


# ---- metrics --------------------------------------------------------------------------------------------


def agent_sums(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Counters to sum over controllers (every key always present): trajectories, turns, tool calls,
    failed calls by kind, truncated episodes (stopped at the length limit), environment reward."""
    sums = {
        "agent/trajectories": float(len(trajectories)),
        "agent/turns": float(sum(t.num_turns for t in trajectories)),
        "agent/tool_calls": float(sum(t.tool_calls for t in trajectories)),
        "agent/truncated": float(sum(t.stop_reason == "max_length" for t in trajectories)),
        "agent/env_reward": float(sum(t.reward for t in trajectories)),
    }
    for kind in TOOL_ERROR_KINDS:
        sums[f"agent/tool_errors/{kind}"] = float(sum(t.tool_errors.get(kind, 0) for t in trajectories))
    return sums


def agent_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The logged metrics from (summed) `agent_sums`: agent/turns_mean, agent/env_reward_mean,
    agent/tool_success (the fraction of calls that ran without error; 0 with no calls), the counts
    agent/tool_calls, agent/tool_errors/<kind>, agent/truncated as they are; and, where the sums hold a
    validation with the tools withheld (`val/no_tools_correct`, `val/no_tools_total`), val/accuracy_no_tools."""
    n = max(sums["agent/trajectories"], 1.0)
    out = {"agent/turns_mean": sums["agent/turns"] / n, "agent/env_reward_mean": sums["agent/env_reward"] / n}
    errors = 0.0
    for key, value in sums.items():
        if key in ("agent/tool_calls", "agent/truncated") or key.startswith("agent/tool_errors/"):
            out[key] = value
        errors += value if key.startswith("agent/tool_errors/") else 0.0
    calls = sums["agent/tool_calls"]
    out["agent/tool_success"] = (calls - errors) / calls if calls else 0.0
    if sums.get("val/no_tools_total"):
        out["val/accuracy_no_tools"] = sums["val/no_tools_correct"] / sums["val/no_tools_total"]
    return out
