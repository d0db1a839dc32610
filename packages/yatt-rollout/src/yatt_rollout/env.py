"""Multi-turn environments: the `Environment` protocol, a registry by name, and tool calls in the Qwen/Hermes
format.

An environment is a plain Python class: `reset(row) -> Observation` starts an episode from a dataset row (a
dict), `step(action) -> StepResult` answers one model turn. `register("name", factory)` puts a factory in
the explicit `ENVIRONMENTS` dict and `make_env("name")` builds one instance per episode: nothing is found by
import magic, a module that defines an environment registers it when imported.

Tools are JSON-schema functions (`ToolSpec`); the model calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format of Qwen2.5/Hermes chat templates).
`parse_tool_calls` reads every call of a turn and reports each unparseable one as malformed.
`ToolEnvironment` is the common shape: a turn with tool calls gets one tool message per call (errors are
messages too, counted by kind); a turn without calls is the final answer, scored by `score`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from yatt_rollout.types import Action, Message, Observation, StepResult, ToolCall, ToolSpec


@runtime_checkable
class Environment(Protocol):
    """One episode's state. `tools` are the functions the model may call (empty: none)."""

    tools: Sequence[ToolSpec]

    def reset(self, row: Mapping[str, Any]) -> Observation: ...

    def step(self, action: Action) -> StepResult: ...


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {}


def register(name: str, factory: Callable[[], Environment]) -> Callable[[], Environment]:
    """Register `factory` (a class or a function of no arguments) under `name`; returns it (so a class
    can be registered where it is defined). Re-registering a name replaces it."""
    if not name:
        raise ValueError("register: the environment name is empty")
    ENVIRONMENTS[name] = factory
    return factory


def make_env(name: str) -> Environment:
    """A new instance of the environment registered as `name`."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]()


# ---- tool calls in the Hermes format --------------------------------------------------------------------

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def render_tool_call(call: ToolCall) -> str:
    return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Every `<tool_call>...</tool_call>` of `text`: the calls that parse, and one problem per call that does
    not (not JSON, not an object with a string `name` and an object `arguments`, or an unclosed tag).
    `arguments` given as a JSON string (some models write it so) is decoded."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    for body in _CALL.findall(text):
        call = _parse_one(body.strip())
        if isinstance(call, str):
            problems.append(call)
        else:
            calls.append(call)
    unclosed = text.count("<tool_call>") - text.count("</tool_call>")
    problems += ["<tool_call> without </tool_call>"] * max(unclosed, 0)
    return calls, problems


def _parse_one(body: str) -> ToolCall | str:
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as err:
        return f"tool call is not valid JSON ({err.msg} at char {err.pos}): {body[:80]!r}"
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return f'tool call must be an object with a string "name": {body[:80]!r}'
    arguments = doc.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f'tool call "arguments" is a string that is not JSON: {arguments[:80]!r}'
    if not isinstance(arguments, dict):
        return f'tool call "arguments" must be an object, got {type(arguments).__name__}'
    return ToolCall(name=doc["name"], arguments=arguments)


def tool_schemas(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The `tools=` argument of `apply_chat_template`: OpenAI-style function entries."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def tools_system_prompt(tools: Sequence[ToolSpec]) -> str:
    """The Hermes tool block, for chat templates that do not render `tools` themselves."""
    lines = "\n".join(json.dumps(schema) for schema in tool_schemas(tools))
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def with_tools(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, `apply_chat_template` keyword arguments) that show `tools` to the model: their schemas as
    `tools=` where the tokenizer's chat template renders tools itself, else the Hermes block
    (`tools_system_prompt`) appended to the system message (one is added when there is none)."""
    messages = list(messages)
    if not tools:
        return messages, {}
    if "tools" in (tokenizer.chat_template or ""):
        return messages, {"tools": tool_schemas(tools)}
    block = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + block}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages, {}


# ---- the common shape: tools, then a final answer -------------------------------------------------------


class ToolEnvironment:
    """An environment whose model calls `tools` (a list of `yatt_rollout.tools.Tool`) and ends the episode
    with a turn that calls none. Subclasses set `tools_by_name` through `__init__`, build the prompt in
    `reset` and score the final answer in `score(text) -> float`."""

    def __init__(self, tools: Sequence[Any]) -> None:
        self.tools_by_name = {tool.name: tool for tool in tools}
        self.tools: Sequence[ToolSpec] = [tool.spec for tool in tools]

    def reset(self, row: Mapping[str, Any]) -> Observation:
        self.row = dict(row)
        return Observation(messages=[Message(role="user", content=str(row["prompt"]))])

    def score(self, text: str) -> float:
        return 0.0

    def step(self, action: Action) -> StepResult:
        if not action.tool_calls and not action.malformed:
            return StepResult(observation=Observation(), reward=self.score(action.text), done=True)
        messages, errors = [], []
        for problem in action.malformed:
            messages.append(Message(role="tool", content=f"error: malformed tool call: {problem}"))
            errors.append("malformed")
        for call in action.tool_calls:
            tool = self.tools_by_name.get(call.name)
            if tool is None:
                known = sorted(self.tools_by_name)
                messages.append(
                    Message(role="tool", content=f"error: unknown tool {call.name!r}; tools: {known}")
                )
                errors.append("unknown_tool")
                continue
            result = tool(call.arguments)
            if result.status != "ok":
                errors.append(result.status)
            content = result.output if result.status == "ok" else f"error: {result.status}: {result.output}"
            messages.append(Message(role="tool", content=content))
        calls = len(action.tool_calls) + len(action.malformed)
        return StepResult(observation=Observation(messages=messages), tool_calls=calls, tool_errors=errors)
