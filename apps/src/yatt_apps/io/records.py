"""One reader of record files for every dataset the jobs load whole: prompt rows (`data.load_rows`) and SFT rows
(`sft_data.load_sft_rows`). A record is one JSON object per non-blank jsonl line, or one parquet row; each comes
with where it was read (`FILE:LINE`, 1-based, blank lines counted, or the parquet row as the caller words it),
so a row's own validation names it exactly. (`row_sources` reads the same files row by row, for shards.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec


def read_records(path: str | Path, *, parquet_where: str = "{path}: row {n}") -> list[tuple[str, Any]]:
    """(where, raw record) for every record of a .jsonl or .parquet file, in file order. `parquet_where` words a
    parquet row's place (`{path}`, `{n}` 1-based). A missing file, an unknown suffix, a line that is not JSON
    or a file without records is a ValueError naming the file (and line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset not found: {path}")
    if path.suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{lineno}", msgspec.json.decode(line)))
            except UnicodeDecodeError as err:  # msgspec decodes the bytes as UTF-8 first
                raise ValueError(f"{path}:{lineno}: not UTF-8 text: {err}") from None
            except msgspec.DecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {err}") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pylist()
        records = [(parquet_where.format(path=path, n=n), raw) for n, raw in enumerate(table, start=1)]
    else:
        raise ValueError(f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or .parquet)")
    if not records:
        raise ValueError(f"{path}: no rows")
    return records
