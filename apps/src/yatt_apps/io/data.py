"""Datasets for the jobs: user files (jsonl or parquet with prompt and answer columns, images for VLM) and the
embedded arithmetic task of the tiny preset.

Every row is validated when the file is read: a bad row raises `ValueError` naming the file, the row (the
1-based line for jsonl, `row N (1-based)` for parquet and for the prompt-length check) and the field, before
any training starts.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec


class PromptRow(msgspec.Struct, kw_only=True, frozen=True):
    """One task: the prompt text, the expected answer (for rule rewards and judges), optional image paths."""

    prompt: str
    answer: str
    images: list[str] = []


def _row(raw: object, where: str, keys: dict[str, str], base: Path) -> PromptRow:
    if not isinstance(raw, dict):
        raise ValueError(
            f"{where}: expected an object with fields {sorted(keys.values())}, got {type(raw).__name__}"
        )
    doc = {}
    for field, key in keys.items():
        if key in raw:
            doc[field] = raw[key]
        elif field != "images":
            raise ValueError(f"{where}: missing field {key!r}")
    try:
        row = msgspec.convert(doc, PromptRow)
    except msgspec.ValidationError as err:
        field = str(err).rsplit("$.", 1)[-1].rstrip("`").split("[")[0]
        raise ValueError(f"{where}: field {keys.get(field, field)!r}: {err}") from None
    if not row.prompt.strip():
        raise ValueError(f"{where}: field {keys['prompt']!r} is empty")
    for image in row.images:
        if not (base / image).is_file():
            raise ValueError(f"{where}: field {keys['images']!r}: image not found: {base / image}")
        _check_decodes(base / image, f"{where}: field {keys['images']!r}")
    if row.images:  # resolved here: controllers and engines need not share the reader's folder
        row = msgspec.structs.replace(row, images=[str((base / image).resolve()) for image in row.images])
    return row


def _check_decodes(path: Path, where: str) -> None:
    """A corrupt image fails here, naming the row, not later inside a rollout engine."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{where}: image {path} cannot be decoded: {err}") from None


def load_rows(
    path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer", image_key: str = "images"
) -> list[PromptRow]:
    """Read and validate a jsonl or parquet file. Image paths are relative to the file's folder; each image
    must decode, and the rows hold them as absolute paths."""
    from yatt_apps.io.records import read_records

    path = Path(path)
    keys = {"prompt": prompt_key, "answer": answer_key, "images": image_key}
    records = read_records(path, parquet_where="{path}: row {n} (1-based)")
    return [_row(raw, where, keys, path.parent) for where, raw in records]


def check_prompt_lengths(rows: list[PromptRow], lengths: list[int], max_tokens: int, source: str) -> None:
    """Fail on the first prompt longer than `max_tokens` tokens, naming its row as `load_rows` does (the
    jsonl line, or the 1-based row)."""
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        if n > max_tokens:
            raise ValueError(
                f"{_where(source, i)}: prompt has {n} tokens, more than max_prompt_tokens={max_tokens}: "
                f"{row.prompt[:60]!r}"
            )


def _where(source: str, index: int) -> str:
    """`FILE:LINE` for the `index`-th (0-based) row of a jsonl file (blank lines are not rows), else
    `SOURCE: row N (1-based)`."""
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        lines = [n for n, line in enumerate(path.read_bytes().splitlines(), start=1) if line.strip()]
        if index < len(lines):
            return f"{path}:{lines[index]}"
    return f"{source}: row {index + 1} (1-based)"


def arithmetic_task(num_rows: int, *, seed: int = 0, max_operand: int = 20) -> list[PromptRow]:
    """The embedded verifiable task: 'a + b' / 'a - b' questions with integer answers, deterministic in seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        answer = a + b if op == "+" else a - b
        rows.append(PromptRow(prompt=f"{a} {op} {b} =", answer=str(answer)))
    return rows
