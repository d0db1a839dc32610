"""What a request becomes on its way into an `HFEngine` batch: the validated request and its sample rows,
its decoding constraint (`choices` as token ids, or `allowed_token_ids`), and a VLM prompt's inputs (images
through the processor, expanded `<|image_pad|>` placeholders, M-RoPE positions for the prefill and the per-row
deltas each decode step adds)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from yatt_rollout.constraints import Spec, choice_token_ids
from yatt_rollout.media import expand_image_tokens, load_image
from yatt_rollout.types import Completion, GenerateRequest


@dataclass
class BatchRequest:
    """A validated request: expanded token ids, its image tensors, and where its completions gather."""

    req: GenerateRequest
    token_ids: list[int]
    vision: dict[str, torch.Tensor]  # pixel_values, image_grid_thw (empty for text prompts)
    future: Future
    constraint: Spec | None = None  # choices' token ids or allowed ids (constraints.py)
    done: dict[int, Completion] = field(default_factory=dict)


@dataclass
class BatchRow:
    """One sample (`index` of the request's `n`) as the engine's worker batches it."""

    request: BatchRequest
    index: int  # sample index within the request, 0..n-1
    # what the row generated before its batch's current segment (a segment ends at each admission)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # the batch's decode step that sampled the row's first token (its version runs count from it)
    start: int = 0

    @property
    def ids(self) -> list[int]:
        """The row's context at the start of the current segment: prompt, then its tokens so far."""
        return self.request.token_ids + self.tokens


def request_constraint(
    req: GenerateRequest, tokenizer: Any, eos_ids: list[int], vocab_size: int
) -> Spec | None:
    """The request's choices as token ids (or its allowed ids); ValueError naming the field."""
    s, rid = req.sampling, req.request_id
    if s.allowed_token_ids:
        bad = max(s.allowed_token_ids)
        if bad >= vocab_size:
            raise ValueError(
                f"request {rid}: sampling.allowed_token_ids has {bad}, outside the vocabulary [0, {vocab_size})"
            )
        return ("allowed", (tuple(sorted(set(s.allowed_token_ids))),))
    if not s.choices:
        return None
    if tokenizer is None:
        raise ValueError(f"request {rid}: sampling.choices needs a tokenizer; this HFEngine has none")
    if not eos_ids:
        raise ValueError(
            f"request {rid}: sampling.choices needs an eos token to end a choice; the engine has none"
        )
    seqs = choice_token_ids(tokenizer, s.choices)
    longest = max(map(len, seqs)) + 1
    if s.max_new_tokens < longest:
        raise ValueError(
            f"request {rid}: sampling.max_new_tokens is {s.max_new_tokens}; the longest choice takes "
            f"{longest} tokens with eos"
        )
    return ("choices", seqs)


def vision_inputs(
    req: GenerateRequest, ids: list[int], image_processor: Any, image_token_id: int | None
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A VLM prompt's ids with its `<|image_pad|>` placeholders expanded, and its image tensors
    (pixel_values, image_grid_thw); ValueError names the request."""
    if image_processor is None or image_token_id is None:
        raise ValueError(
            f"request {req.request_id}: prompt has media but the engine has no VLM and processor"
        )
    try:
        images = [load_image(ref) for ref in req.prompt.media]  # names a missing or unreadable file
        out = image_processor(images=images, return_tensors="pt")
        merge = image_processor.merge_size**2
        counts = [int(thw.prod()) // merge for thw in out["image_grid_thw"]]
        ids = expand_image_tokens(ids, image_token_id, counts)
    except ValueError as err:
        raise ValueError(f"request {req.request_id}: {err}") from err
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def prefill_inputs(
    model: Any,
    image_token_id: int | None,
    vision: list[dict[str, torch.Tensor]],
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    text_pos: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Model kwargs of the prefill; for a VLM also the per-row M-RoPE deltas [B, 1] used when decoding."""
    if image_token_id is None:
        return {"position_ids": text_pos}, None
    kwargs: dict[str, torch.Tensor] = {"mm_token_type_ids": (input_ids == image_token_id).long()}
    if vision:
        kwargs["pixel_values"] = torch.cat([v["pixel_values"] for v in vision]).to(input_ids.device)
        kwargs["image_grid_thw"] = torch.cat([v["image_grid_thw"] for v in vision]).to(input_ids.device)
    pos3, deltas = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=kwargs["mm_token_type_ids"],
        image_grid_thw=kwargs.get("image_grid_thw"),
        attention_mask=mask,
    )
    kwargs["position_ids"] = torch.cat([text_pos[None], pos3])  # [4, B, T]: text positions, then t/h/w
    return kwargs, deltas.reshape(-1, 1)


def mrope_step(pos: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Positions of a decode step for M-RoPE: [4, B, 1] = text position, then t/h/w = text + row delta."""
    shifted = (pos + deltas.to(pos.device))[None].expand(3, -1, -1)
    return torch.cat([pos[None], shifted])
