"""Vision-language inputs for the Qwen2-VL family, and the codec that makes `GenRMJudge` a VLM judge.

A Qwen2-VL prompt marks each image as `<|vision_start|><|image_pad|><|vision_end|>`. Judge prompts sent to a
yatt-rollout engine carry one `<|image_pad|>` per image (the engine expands it: yatt-rollout's convention);
`qwen2_vl_inputs` does the expansion itself, for a forward pass (logprobs, a VLM reward model): each
placeholder becomes `prod(image_grid_thw) / merge_size**2` pad tokens, and in transformers 5 the model needs
`mm_token_type_ids` (0 text, 1 image, 2 video) beside `pixel_values` and `image_grid_thw`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yatt_multimodal.prompt_codecs import encode_chat, own_turn

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


class QwenVLCodec:
    """A `PromptCodec` for Qwen2-VL judges: the tokenizer's chat template, the user turn opening with one
    image placeholder per image (unexpanded), generation prompt added. The texts are ordinary tokens
    (`prompt_codecs.encode_chat`): a response spelling out `<|image_pad|>` or `<|im_start|>` adds none."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        if tokenizer.convert_tokens_to_ids(IMAGE_PAD) in (None, tokenizer.unk_token_id):
            raise ValueError(f"QwenVLCodec: the tokenizer has no {IMAGE_PAD} token")

    def encode_prompt(self, system: str, user: str, num_images: int = 0) -> list[int]:
        return encode_chat(
            self.tokenizer,
            [("system", system), ("user", user)],
            markup=["", IMAGE_PLACEHOLDER * num_images],
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(own_turn(self.tokenizer, token_ids), skip_special_tokens=True)


def expand_image_pads(token_ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """Replace the i-th `pad_id` with `counts[i]` copies. The number of pads must equal `len(counts)`."""
    found = sum(t == pad_id for t in token_ids)
    if found != len(counts):
        raise ValueError(f"prompt has {found} image placeholder(s) but {len(counts)} image(s) were given")
    out, image = [], 0
    for t in token_ids:
        if t == pad_id:
            out.extend([pad_id] * counts[image])
            image += 1
        else:
            out.append(t)
    return out


def qwen2_vl_inputs(
    tokenizer: Any, image_processor: Any, token_ids: Sequence[int], images: Sequence[Any]
) -> dict:
    """Model inputs for one prompt with one placeholder per image (PIL images, e.g. from `media.load_image`):
    input_ids, attention_mask, mm_token_type_ids  # [1, T]
    pixel_values  # [sum of patches, C * temporal_patch * patch**2]
    image_grid_thw  # [num_images, 3]
    """
    import torch

    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    vision: dict[str, Any] = {}
    counts: list[int] = []
    if images:
        vision = dict(image_processor(images=list(images), return_tensors="pt"))
        merge = getattr(image_processor, "merge_size", 2)
        counts = (vision["image_grid_thw"].prod(dim=-1) // merge**2).tolist()
    ids = torch.tensor([expand_image_pads(token_ids, pad_id, counts)], dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == pad_id).long(),  # 1 marks image tokens; this builds no video inputs
        **vision,
    }
