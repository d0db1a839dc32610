"""Supervised fine-tuning data: prompt/response rows, or multi-turn chat rows with tool calls, read from jsonl
or parquet; chat-templated token ids with a response mask, padded batches and the masked token NLL.

A chat row is TRL's conversational format: `{"messages": [...], "tools": [...]}`, messages with `role` in
system/user/assistant/tool, an assistant's `tool_calls` (`{"type": "function", "function": {"name",
"arguments"}}`), `tools` the JSON schemas the chat template renders (`apply_chat_template(..., tools=)`). It
is laid out exactly as an agentic episode (`yatt_rollout.agent.TurnCodec.conversation_ids`): the loss is on
the assistant turns only (content, tool calls, the eos that ends each), never on prompts or tool results.

Shared by `yatt sft` (the job) and the warm start of the tiny models (`yatt_apps.runtime.warmstart`), so both train on
exactly the same layout: the chat template's generation prompt, then the response tokens through the end of
the assistant turn (its eos), and loss only on the response.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.io.data import PromptRow


class SFTRow(msgspec.Struct, kw_only=True, frozen=True):
    """One supervised example: the user's prompt and the assistant's response."""

    prompt: str
    response: str


class ChatRow(PromptRow, kw_only=True, frozen=True):
    """A multi-turn SFT row: TRL-format `messages` (and `tools`), as a PromptRow (`prompt`: the first user
    message, `answer`: the last assistant message's content) so that length checks and corpora read it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)


ROLES = ("system", "user", "assistant", "tool")


def _call_problem(call: object) -> str:
    if not isinstance(call, dict):
        return f"must be an object, got {type(call).__name__}"
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return 'needs "function": {"name": <non-empty string>, "arguments": ...}'
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return '"arguments" is a string that is not JSON'
    return "" if isinstance(arguments, dict) else '"arguments" must be an object'


def _chat_row(raw: dict, where: str) -> ChatRow:
    """Validate TRL's conversational format; every problem names the message index and field."""
    messages, tools = raw["messages"], raw.get("tools") or []
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where}: messages[{i}].role must be one of {list(ROLES)}")
        calls = m.get("tool_calls") or []
        if not isinstance(m.get("content", ""), str | type(None)):
            raise ValueError(f"{where}: messages[{i}].content must be a string")
        if not (m.get("content") or calls):
            raise ValueError(f"{where}: messages[{i}] ({m['role']}) has no content")
        if calls and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise ValueError(f"{where}: messages[{i}].tool_calls must be a list on an assistant message")
        for j, call in enumerate(calls):
            if problem := _call_problem(call):
                raise ValueError(f"{where}: messages[{i}].tool_calls[{j}] {problem}")
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        raise ValueError(f"{where}: field 'messages' has no assistant message (nothing to learn)")
    if not isinstance(tools, list) or any(_tool_spec(t) is None for t in tools):
        raise ValueError(f"{where}: field 'tools' must be a list of JSON-schema functions with a name")
    user = next((m["content"] for m in messages if m["role"] == "user"), "")
    return ChatRow(
        prompt=user or "", answer=assistant[-1].get("content") or "", messages=messages, tools=tools
    )


def _tool_spec(schema: object) -> Any:
    """A `ToolSpec` of one `tools` entry (`{"type": "function", "function": {...}}` or the function itself)."""
    from yatt_rollout.types import ToolSpec

    fn = schema.get("function", schema) if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None
    return ToolSpec(
        name=fn["name"], description=str(fn.get("description", "")), parameters=fn.get("parameters", {})
    )


def _row(raw: object, where: str, prompt_key: str, response_key: str) -> SFTRow | ChatRow:
    if isinstance(raw, dict) and "messages" in raw:
        return _chat_row(raw, where)
    if not isinstance(raw, dict):
        raise ValueError(
            f"{where}: expected an object with fields {[prompt_key, response_key]}, got {type(raw).__name__}"
        )
    for key in (prompt_key, response_key):
        if key not in raw:
            raise ValueError(f"{where}: missing field {key!r}")
        if not isinstance(raw[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(raw[key]).__name__}")
        if not raw[key].strip():
            raise ValueError(f"{where}: field {key!r} is empty")
    return SFTRow(prompt=raw[prompt_key], response=raw[response_key])


def load_sft_rows(
    path: str | Path, *, prompt_key: str = "prompt", response_key: str = "response"
) -> list[SFTRow | ChatRow]:
    """Read and validate a jsonl or parquet file; a bad row raises ValueError naming the file, its 1-based line
    (jsonl) or row (parquet), and the field. A row with `messages` is a chat row (TRL's format)."""
    from yatt_apps.io.records import read_records

    return [_row(raw, where, prompt_key, response_key) for where, raw in read_records(path)]


def chat_messages(system: str, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def encode_pair(tok: Any, messages: list[dict[str, str]], response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one example. The prompt is the chat template with its generation prompt
    (exactly what a rollout engine or `HFChatCodec` is given); the response is the template's assistant turn
    after it, up to and including the eos that ends the turn (text the template adds after eos is no target).
    Special tokens spelled in the texts are encoded as plain text (`prompt_codecs.encode_chat`)."""
    if not getattr(tok, "chat_template", None):
        prompt = _ids(tok("\n".join(m["content"] for m in messages) + "\n", add_special_tokens=False))
        return prompt, [*_ids(tok(response, add_special_tokens=False)), tok.eos_token_id]
    from yatt_multimodal.prompt_codecs import encode_chat

    # the texts are data: special tokens spelled in a prompt or response are encoded as plain text
    turns = [(m["role"], m["content"]) for m in messages]
    prompt = encode_chat(tok, turns)
    full = encode_chat(tok, [*turns, ("assistant", response)], generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise ValueError(
            "the chat template does not render the conversation as prompt + response; cannot mask the prompt"
        )
    reply = full[len(prompt) :]
    eos = tok.eos_token_id
    reply = reply[: len(reply) - reply[::-1].index(eos)] if eos in reply else [*reply, eos]
    return prompt, reply


def encode_conversation(
    tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], system_prompt: str = ""
) -> tuple[list[int], list[int]]:
    """(ids, mask) of a chat row laid out as an agentic episode: mask 1 on the assistant turns' tokens.
    `system_prompt` goes first unless the row has its own system message."""
    from yatt_rollout.agent import TurnCodec

    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return TurnCodec(tok).conversation_ids(messages, [_tool_spec(t) for t in tools])


def pad_masked(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    """`pad_examples` for (ids, mask) pairs: response_mask True where mask is 1."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.bool)
    response = torch.zeros_like(attention)
    for i, (ids, mask) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = True
        response[i, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response}


def pad_examples(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-padded [B, T] input_ids, attention_mask and response_mask (True on response tokens)."""
    import torch

    width = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.bool)
    response = torch.zeros_like(attention)
    for i, (p, r) in enumerate(examples):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = True
        response[i, len(p) : len(p) + len(r)] = True
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response}


def token_nll(model: Any, batch: dict[str, Any]) -> Any:
    """Per-token negative log-likelihood [B, T] of input_ids (position t scored from the logits at t - 1;
    0 at position 0), and the model output."""
    import torch

    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(), use_cache=False
    ).logits
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten(), reduction="none"
    ).view(logits.shape[0], -1)
    return torch.nn.functional.pad(nll, (1, 0))


def masked_nll(model: Any, batch: dict[str, Any]) -> Any:
    """The mean NLL over response tokens (the SFT loss) of a padded batch."""
    mask = batch["response_mask"].float()
    return (token_nll(model, batch) * mask).sum() / mask.sum().clamp(min=1.0)
