"""Prompt codecs: how a judge turns its (system, user) texts into the token ids a `Generator` reads, and the
judge's completion tokens back into text.

`HFChatCodec` wraps a Hugging Face tokenizer (its chat template when it has one); `ByteCodec` is UTF-8 bytes
as ids (256-symbol vocabulary), a real codec for byte-level engines and for scripted judges in tests.
The VLM codec (image placeholders expanded by the processor) lives in `yatt_multimodal.vlm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PromptCodec(Protocol):
    """`encode_prompt(system, user, num_images)` -> prompt token ids, ready for generation (generation
    prompt appended); `decode(ids)` -> text without special tokens."""

    def encode_prompt(self, system: str, user: str, num_images: int = 0) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteCodec:
    """UTF-8 bytes as token ids. The prompt is `system + "\\n\\n" + user + "\\n"`; bytes that do not form
    valid UTF-8 decode to U+FFFD. No images."""

    def encode_prompt(self, system: str, user: str, num_images: int = 0) -> list[int]:
        if num_images:
            raise ValueError("ByteCodec cannot encode images; use yatt_multimodal.vlm.QwenVLCodec")
        return list(f"{system}\n\n{user}\n".encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


class HFChatCodec:
    """A Hugging Face tokenizer: the chat template where the tokenizer has one (system + user message,
    generation prompt added), else `system\\n\\nuser\\n` tokenized plainly. Text only."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode_prompt(self, system: str, user: str, num_images: int = 0) -> list[int]:
        if num_images:
            raise ValueError("HFChatCodec is text-only; use yatt_multimodal.vlm.QwenVLCodec for images")
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(f"{system}\n\n{user}\n", add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
