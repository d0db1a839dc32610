"""Discriminative reward model: a Hugging Face sequence-classification model (one label) scoring
(prompt, response) pairs in length-sorted batches.

The text is the tokenizer's chat template over a user and an assistant turn where it has one, else
`prompt + response`. The score is the model's logit at the last non-pad token (HF's pooling for
`*ForSequenceClassification`), optionally through a sigmoid. A pair longer than `max_length` tokens is an
"error" for that request, never silently truncated. Needs torch and transformers (yatt-rollout's extra "hf").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from yatt_multimodal.rewards import RewardBatch, count_statuses, failed
from yatt_multimodal.types import Reward, RewardRequest


class SequenceClassifierReward:
    """A `RewardFunction` over `model` (e.g. `Qwen2ForSequenceClassification`, `num_labels=1`)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "rm",
        batch_size: int = 16,
        max_length: int = 1024,
        sigmoid: bool = False,
        timeout_s: float = 300.0,
    ):
        if model.config.num_labels != 1:
            raise ValueError(
                f"SequenceClassifierReward: model must have num_labels=1, got {model.config.num_labels}"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError("SequenceClassifierReward: the tokenizer has no pad token")
        model.config.pad_token_id = tokenizer.pad_token_id  # pooling finds the last non-pad token
        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.batch_size, self.max_length, self.sigmoid, self.timeout_s = (
            batch_size,
            max_length,
            sigmoid,
            timeout_s,
        )

    def encode(self, request: RewardRequest) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            messages = [
                {"role": "user", "content": request.prompt},
                {"role": "assistant", "content": request.response},
            ]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = request.prompt + request.response
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def logits(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One logit per sequence, batched by length (longest first) and returned in input order."""
        import torch

        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        out = [0.0] * len(sequences)
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = len(sequences[chunk[0]])
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [B, T], right-padded
            mask = torch.zeros_like(ids)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask).logits[:, 0]  # [B]
            for row, i in enumerate(chunk):
                out[i] = float(logits[row])
        return out

    def score_sync(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        import math

        encoded = [self.encode(r) for r in requests]
        ok = [i for i, ids in enumerate(encoded) if 0 < len(ids) <= self.max_length]
        values = dict(zip(ok, self.logits([encoded[i] for i in ok]), strict=True))
        rewards: list[Reward] = []
        for i, request in enumerate(requests):
            if i not in values:
                msg = f"{self.name}: {len(encoded[i])} tokens, outside 1..max_length={self.max_length}"
                rewards.append(failed(request, "error", msg))
                continue
            value = 1 / (1 + math.exp(-values[i])) if self.sigmoid else values[i]
            rewards.append(Reward(request_id=request.request_id, score=value, components={self.name: value}))
        return RewardBatch(rewards, count_statuses(rewards))

    async def score(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        """The batch in a worker thread, bounded by `timeout_s` (on timeout every request is "timeout")."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.score_sync, requests), self.timeout_s)
        except TimeoutError:
            rewards = [
                failed(r, "timeout", f"{self.name}: no result within {self.timeout_s}s") for r in requests
            ]
            return RewardBatch(rewards, count_statuses(rewards))
