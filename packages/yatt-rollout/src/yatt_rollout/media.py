"""Images for VLM prompts: load a `MediaRef` and expand its placeholder in the prompt's token ids.

A prompt for the Qwen2-VL family carries `<|vision_start|><|image_pad|><|vision_end|>` per image, with
either one `<|image_pad|>` (the chat template's form) or already as many as the image has tokens
(the processor's form); `expand_image_tokens` turns the first into the second. The count is
`t * h * w / merge_size**2` from the image processor's `image_grid_thw`. pillow is imported when used.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from yatt_rollout.types import MediaRef


def read_media_bytes(ref: MediaRef) -> bytes:
    """The referenced bytes: a plain path, a `file://` URI or a base64 `data:` URI; checks `sha256` if set."""
    if ref.uri.startswith("data:"):
        header, _, payload = ref.uri.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"media uri {ref.uri[:40]!r}...: only base64 data: URIs are supported")
        data = base64.b64decode(payload)
    else:
        path = Path(unquote(urlparse(ref.uri).path)) if ref.uri.startswith("file://") else Path(ref.uri)
        if not path.is_file():
            raise ValueError(f"{ref.kind} file not found: {path}")
        data = path.read_bytes()
    if ref.sha256 and hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"media {ref.uri[:80]!r}: sha256 does not match the referenced bytes")
    return data


def load_image(ref: MediaRef) -> Any:
    """A PIL RGB image for an image `MediaRef`; ValueError naming the uri if it is missing or unreadable."""
    import io

    from PIL import Image, UnidentifiedImageError

    if ref.kind != "image":
        raise ValueError(f"media kind {ref.kind!r} is not supported here; only images")
    try:
        return Image.open(io.BytesIO(read_media_bytes(ref))).convert("RGB")
    except UnidentifiedImageError as err:
        raise ValueError(f"image {ref.uri[:80]!r} is not a readable image file") from err


def expand_image_tokens(token_ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Expand each run of `image_token_id` to `counts[i]` tokens (image i, in order). A run must be one token
    (expanded) or exactly `counts[i]` tokens (kept). ValueError if runs and images disagree."""
    runs: list[tuple[int, int]] = []  # [start, end) of each run of image tokens
    i = 0
    while i < len(token_ids):
        if token_ids[i] == image_token_id:
            start = i
            while i < len(token_ids) and token_ids[i] == image_token_id:
                i += 1
            runs.append((start, i))
        else:
            i += 1
    if len(runs) != len(counts):
        raise ValueError(
            f"prompt has {len(runs)} image placeholders but {len(counts)} images in prompt.media"
        )
    out, cursor = [], 0
    for (start, end), count in zip(runs, counts, strict=True):
        if end - start not in (1, count):
            raise ValueError(f"image placeholder of {end - start} tokens; the image needs 1 or {count}")
        out += token_ids[cursor:start] + [image_token_id] * count
        cursor = end
    return out + token_ids[cursor:]
