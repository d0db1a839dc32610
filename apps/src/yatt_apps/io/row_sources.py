"""Datasets read row by row: what a controller indexes to load only its own shard, and what the driver streams
through once to validate a file without holding its rows.

`open_rows(path)` gives a sequence (len, index) over a jsonl or parquet file: jsonl keeps one byte offset per
row (found by one scan for newlines) and parses a row when it is asked for; parquet reads the row group that
holds the row (the last group read is kept). Every row is validated when read, with the file and the 1-based
line (jsonl) or row (parquet) in the message, exactly as `yatt_apps.io.data.load_rows` does for a whole file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.io.data import PromptRow, _row


class JsonlRows(Sequence):
    """The non-blank lines of a jsonl file as validated `PromptRow`s, parsed on access."""

    def __init__(self, path: Path, keys: dict[str, str]) -> None:
        self.path, self.keys = path, keys
        self.offsets: list[tuple[int, int]] = []  # (byte offset, 1-based line) of each non-blank line
        offset = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    self.offsets.append((offset, lineno))
                offset += len(line)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> PromptRow:  # type: ignore[override]
        offset, lineno = self.offsets[index]
        with open(self.path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            raw = msgspec.json.decode(line)
        except UnicodeDecodeError as err:  # msgspec decodes the bytes as UTF-8 first
            raise ValueError(f"{self.path}:{lineno}: not UTF-8 text: {err}") from None
        except msgspec.DecodeError as err:
            raise ValueError(f"{self.path}:{lineno}: not valid JSON: {err}") from None
        return _row(raw, f"{self.path}:{lineno}", self.keys, self.path.parent)

    def where(self, index: int) -> str:
        return f"{self.path}:{self.offsets[index][1]}"


class ParquetRows(Sequence):
    """The rows of a parquet file as validated `PromptRow`s, read one row group at a time."""

    def __init__(self, path: Path, keys: dict[str, str]) -> None:
        import pyarrow.parquet as pq

        self.path, self.keys = path, keys
        self.file = pq.ParquetFile(path)
        sizes = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.starts = [sum(sizes[:g]) for g in range(len(sizes) + 1)]
        self._group: tuple[int, list[dict]] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> PromptRow:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        group = next(g for g in range(len(self.starts) - 1) if index < self.starts[g + 1])
        if self._group is None or self._group[0] != group:
            self._group = (group, self.file.read_row_group(group).to_pylist())
        raw = self._group[1][index - self.starts[group]]
        return _row(raw, self.where(index), self.keys, self.path.parent)

    def where(self, index: int) -> str:
        return f"{self.path}: row {index + 1}"

    def __getstate__(self) -> dict:  # a controller reopens the file where it runs
        return {"path": self.path, "keys": self.keys}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["path"], state["keys"])


def open_rows(
    path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer", image_key: str = "images"
) -> JsonlRows | ParquetRows:
    """A row-by-row view of a jsonl or parquet dataset (nothing parsed yet)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset not found: {path}")
    keys = {"prompt": prompt_key, "answer": answer_key, "images": image_key}
    if path.suffix == ".jsonl":
        rows: JsonlRows | ParquetRows = JsonlRows(path, keys)
    elif path.suffix == ".parquet":
        rows = ParquetRows(path, keys)
    else:
        raise ValueError(f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or .parquet)")
    if not len(rows):
        raise ValueError(f"{path}: no rows")
    return rows


def stream_check(rows: Sequence[PromptRow], prompt_len: Any, max_tokens: int) -> Iterator[PromptRow]:
    """Every row read, validated and its prompt length checked, one at a time (nothing is held); yields the
    rows for callers that need their text (the tiny tokenizer's corpus)."""
    for i in range(len(rows)):
        row = rows[i]
        n = prompt_len(row)
        if n > max_tokens:
            where = rows.where(i) if hasattr(rows, "where") else f"row {i + 1}"
            raise ValueError(
                f"{where}: prompt has {n} tokens, more than data.max_prompt_tokens={max_tokens}: {row.prompt[:60]!r}"
            )
        yield row
