"""Preference data for `yatt dpo`: rows {"prompt", "chosen", "rejected"} read from jsonl or parquet and validated
row by row, the embedded arithmetic task's pairs, and the padded pair batches the DPO learner trains on.

A prompt is a string (rendered as one user turn, after `data.system_prompt`) or a chat-message list
(`[{"role": "system" | "user" | "assistant", "content": ...}, ...]`, ending with a user turn, used as given).
A response (`chosen`, `rejected`) is a string or a one-message list `[{"role": "assistant", "content": ...}]`
(TRL's conversational form). A bad row raises ValueError naming the file, its 1-based line (jsonl) or row
(parquet), and the field, before any training starts (the `yatt` command turns it into exit status 2).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.io.data import arithmetic_task

ROLES = ("system", "user", "assistant")


class PrefRow(msgspec.Struct, kw_only=True, frozen=True):
    """One preference pair. `prompt` is the prompt's text (a message list's contents joined: what the tiny
    tokenizer learns from and the prompt-length check renders); `messages` the prompt as given when it was a
    chat-message list (empty: `prompt` is one user turn); `answer` the reference answer the generation
    accuracy checks (the row's `answer` field, else `chosen`); `images` stays empty (text pairs only)."""

    prompt: str
    chosen: str
    rejected: str
    messages: list[dict[str, str]] = []
    answer: str = ""
    images: list[str] = []


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if not value:
        raise ValueError(f"{where}: field {key!r} is empty")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise ValueError(f"{where}: field {key!r}[{i}]: expected {{'role': ..., 'content': ...}}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: field {key!r}[{i}]: role {role!r} is not one of {list(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: field {key!r}[{i}]: content must be a string")
        out.append({"role": role, "content": content})
    return out


def _prompt(value: Any, where: str, key: str) -> tuple[str, list[dict[str, str]]]:
    """(text, messages) of a prompt field: a non-empty string, or a message list ending with a user turn."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field {key!r} is empty")
        return value, []
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {key!r} must be a string or a list of messages")
    messages = _messages(value, where, key)
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: field {key!r}: the last message must be the user's")
    return "\n".join(m["content"] for m in messages), messages


def _response(value: Any, where: str, key: str) -> str:
    """A response field's text: a non-empty string, or one assistant message holding it."""
    if isinstance(value, list):
        messages = _messages(value, where, key)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise ValueError(f"{where}: field {key!r}: expected one message with role 'assistant'")
        value = messages[0]["content"]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string or a list of messages")
    if not value.strip():
        raise ValueError(f"{where}: field {key!r} is empty")
    return value


def pref_row(raw: object, where: str, keys: dict[str, str]) -> PrefRow:
    """One validated row; `keys` maps prompt/chosen/rejected/answer to the file's column names."""
    if not isinstance(raw, dict):
        names = [keys[k] for k in ("prompt", "chosen", "rejected")]
        raise ValueError(f"{where}: expected an object with fields {names}, got {type(raw).__name__}")
    for field in ("prompt", "chosen", "rejected"):
        if keys[field] not in raw:
            raise ValueError(f"{where}: missing field {keys[field]!r}")
    text, messages = _prompt(raw[keys["prompt"]], where, keys["prompt"])
    chosen = _response(raw[keys["chosen"]], where, keys["chosen"])
    rejected = _response(raw[keys["rejected"]], where, keys["rejected"])
    if chosen == rejected:
        raise ValueError(f"{where}: fields {keys['chosen']!r} and {keys['rejected']!r} are the same response")
    answer = raw.get(keys["answer"], chosen)
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field {keys['answer']!r} must be a string")
    return PrefRow(prompt=text, chosen=chosen, rejected=rejected, messages=messages, answer=answer)


def load_pref_rows(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    answer_key: str = "answer",
) -> list[PrefRow]:
    """Read and validate a jsonl or parquet file of preference pairs (every row, in file order)."""
    from yatt_apps.io.records import read_records

    keys = {"prompt": prompt_key, "chosen": chosen_key, "rejected": rejected_key, "answer": answer_key}
    return [pref_row(raw, where, keys) for where, raw in read_records(path)]


def rejected_answer(answer: int, a: int, b: int, rng: random.Random) -> str:
    """A wrong or badly formatted answer to `a op b = answer`, the failure modes of a tiny policy: off by one
    to three (half), a sign slip, an operand echoed, or the right number in a bad format."""
    kind = rng.random()
    if kind < 0.5 or (kind < 0.65 and answer == 0) or (0.65 <= kind < 0.8 and a == answer):
        return str(answer + rng.choice([-3, -2, -1, 1, 2, 3]))
    if kind < 0.65:
        return str(-answer)
    if kind < 0.8:
        return str(a)
    return rng.choice([f"= {answer}", f"{answer} {answer}", f"{answer} =", f"{a} + {b}"])


def arithmetic_pairs(num_rows: int, *, seed: int = 0) -> list[PrefRow]:
    """The embedded task's pairs: the rows of `arithmetic_task(num_rows, seed=seed)` (so a tiny model's
    tokenizer and warm start are the other tiny jobs'), chosen the correct answer, rejected one of
    `rejected_answer`'s, deterministic in seed."""
    rng = random.Random(seed + 7)
    pairs = []
    for row in arithmetic_task(num_rows, seed=seed):
        a, _, b, _ = row.prompt.split()
        wrong = rejected_answer(int(row.answer), int(a), int(b), rng)
        pairs.append(PrefRow(prompt=row.prompt, chosen=row.answer, rejected=wrong, answer=row.answer))
    return pairs


def prompt_messages(row: PrefRow, system_prompt: str) -> list[dict[str, str]]:
    """The chat prompt of a pair: its own message list, else the system prompt (if any) and one user turn."""
    if row.messages:
        return row.messages
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": row.prompt}
    ]


def pair_batch(tok: Any, rows: list[PrefRow], system_prompt: str) -> dict[str, Any]:
    """The DPO learner's batch of `rows`, every field [B, T] (T: the longest chosen or rejected sequence):
    `input_ids` / `rejected_input_ids` (prompt + response, right padded), `chosen_attention_mask` /
    `rejected_attention_mask`, `chosen_response_mask` / `rejected_response_mask` (True on response tokens,
    through the turn's eos), and the unions `attention_mask` / `response_mask` that the learner's micro-batch
    packing and token counts read (a pair is one row: its two sequences always share a micro-batch)."""
    from yatt_apps.io.sft_data import encode_pair, pad_examples

    chosen, rejected = [], []
    for row in rows:
        messages = prompt_messages(row, system_prompt)
        chosen.append(encode_pair(tok, messages, row.chosen))
        rejected.append(encode_pair(tok, messages, row.rejected))
    c = pad_examples(chosen, tok.pad_token_id)
    r = pad_examples(rejected, tok.pad_token_id)
    width = max(c["input_ids"].shape[1], r["input_ids"].shape[1])
    c, r = _widen(c, width, tok.pad_token_id), _widen(r, width, tok.pad_token_id)
    return {
        "input_ids": c["input_ids"],
        "attention_mask": c["attention_mask"] | r["attention_mask"],
        "response_mask": c["response_mask"] | r["response_mask"],
        "rejected_input_ids": r["input_ids"],
        "chosen_attention_mask": c["attention_mask"],
        "rejected_attention_mask": r["attention_mask"],
        "chosen_response_mask": c["response_mask"],
        "rejected_response_mask": r["response_mask"],
    }


def _widen(batch: dict[str, Any], width: int, pad_id: int) -> dict[str, Any]:
    """Right-pad every [B, T] field of a `pad_examples` batch to `width` columns."""
    import torch.nn.functional as F

    extra = width - batch["input_ids"].shape[1]
    if not extra:
        return batch
    return {k: F.pad(v, (0, extra), value=pad_id if k == "input_ids" else False) for k, v in batch.items()}
