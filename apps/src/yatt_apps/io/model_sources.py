"""Where a model directory comes from: `model.path` / `judge.path` is a local HF folder or a Hugging Face hub id
(`org/name`, optionally `org/name@revision`), fetched with huggingface_hub's `snapshot_download` into its cache.

With HF_HUB_OFFLINE set (the jobs set it by default) only the local cache is consulted (`local_files_only`);
an id that is not there, or cannot be downloaded, is a ValueError naming the key, the id and how to point the
key at a local folder instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name with hub-legal characters, optionally @revision; never an existing local path (checked first)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a hub id rather than a local folder (a local folder of that name wins)."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists() and ".." not in path


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_dir(path: str, *, key: str = "model.path", marker: str = "config.json") -> Path:
    """The local HF directory of `path` (`key` names the config field in errors): the folder itself, or the
    cached (else downloaded) snapshot of a hub id. The directory must hold `marker` (a diffusers pipeline's
    is model_index.json)."""
    local = Path(path)
    if not local.exists() and is_hub_id(path):
        local = _snapshot(path, key)
    if not (local / marker).is_file():
        kind = "an HF model directory" if marker == "config.json" else "a diffusers pipeline folder"
        raise ValueError(f"{key} {path!r} is not {kind} (no {marker})")
    return local


def _snapshot(hub_id: str, key: str) -> Path:
    from huggingface_hub import snapshot_download

    repo, _, revision = hub_id.partition("@")
    offline = hub_offline()
    try:
        return Path(snapshot_download(repo, revision=revision or None, local_files_only=offline))
    except Exception as err:  # not cached offline, unknown repo, no network, gated repo: all say the same
        why = "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if offline else str(err)
        raise ValueError(
            f"{key} {hub_id!r}: the hub id could not be fetched ({why}). Download it where there is a network "
            f"(`huggingface-cli download {repo} --local-dir DIR`) and set {key}=DIR (a local folder with "
            "config.json), or unset HF_HUB_OFFLINE to let the job download it"
        ) from err
