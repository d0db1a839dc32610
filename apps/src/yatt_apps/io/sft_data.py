"""Supervised fine-tuning data: prompt/response rows read from jsonl or parquet, chat-templated token ids with
a response mask, padded batches and the masked token NLL.

Shared by `yatt sft` (the job) and the warm start of the tiny models (`yatt_apps.runtime.warmstart`), so both train on
exactly the same layout: the chat template's generation prompt, then the response tokens through the end of
the assistant turn (its eos), and loss only on the response.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec


class SFTRow(msgspec.Struct, kw_only=True, frozen=True):
    """One supervised example: the user's prompt and the assistant's response."""

    prompt: str
    response: str


def _row(raw: object, where: str, prompt_key: str, response_key: str) -> SFTRow:
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
) -> list[SFTRow]:
    """Read and validate a jsonl or parquet file; a bad row raises ValueError naming the file, its 1-based line
    (jsonl) or row (parquet), and the field."""
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
