"""From configs to image rewards: the text-to-image counterpart of `reward_specs`. A weighted list of
`RewardSpec`s (the app's `rewards:` section, the same shape as the LLM jobs') becomes one
`CombinedImageReward` whose `score(requests, images)` scores each (prompt, image) pair with every term and
sums `weight * score`, through `rewards.CombinedReward` (so statuses, the failure policy and the judge counts
are the LLM jobs' own).

Kinds (`IMAGE_REWARDS`), each term under `spec.name or spec.kind` in `Reward.components`:
- "colour_position": the pixel rule of the embedded task (`image_rules`), no resources.
- "image_rm": the CLIP-style Bradley-Terry reward model (`image_rewards.ImageRewardModel`), resource
  `image_rm` (the model; the caller builds it from the spec's options with `image_rm_from_options`).
- "genrm": the VLM judge (`genrm.GenRMJudge` with a Qwen2-VL codec) asked whether each image matches its
  prompt (`image_rewards.consistency_requests`: the image is written as a PNG the judge reads by reference);
  resources `engine`, `codec`, optional `seed` and `folder` (where the PNGs go; default a temporary folder
  this term owns and removes on `close()`).

Images are uint8 [B, H, W, 3] arrays; requests carry the prompts (`RewardRequest.prompt`).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from yatt_multimodal.reward_specs import need
from yatt_multimodal.rewards import CombinedReward, RewardBatch, count_statuses
from yatt_multimodal.types import JudgeSpec, OnFailure, Reward, RewardRequest, RewardSpec

__all__ = [
    "IMAGE_REWARDS",
    "CombinedImageReward",
    "ImageRewardFunction",
    "build_combined_images",
    "build_image_reward",
    "image_rm_from_options",
]

RM_OPTIONS = ("path", "width", "seed", "batch_size")


class ImageRewardFunction(Protocol):
    """A reward of images: one `Reward` per (request, image), in order, never raising for one bad pair."""

    name: str

    async def score_images(self, requests: Sequence[RewardRequest], images: Any) -> RewardBatch: ...


def _renamed(rewards: list[Reward], name: str) -> list[Reward]:
    """Each ok reward's components as one term `name` (its score)."""
    return [
        msgspec.structs.replace(r, components={name: r.score}) if r.status == "ok" else r for r in rewards
    ]


class PixelRule:
    """The embedded task's pixel rule (`image_rules.score_images`): finite numpy on each image, so it runs in
    the caller's thread (no worker processes: nothing here parses untrusted text)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def score_images(self, requests: Sequence[RewardRequest], images: Any) -> RewardBatch:
        from yatt_multimodal.image_rules import score_images

        rewards = _renamed(score_images(list(requests), images), self.name)
        return RewardBatch(rewards, count_statuses(rewards))


class RewardModelTerm:
    """An `ImageRewardModel` scoring `batch_size` images at a time."""

    def __init__(self, model: Any, name: str, batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ValueError(f"image_rm option batch_size must be >= 1, got {batch_size}")
        self.model, self.name, self.batch_size = model, name, batch_size

    async def score_images(self, requests: Sequence[RewardRequest], images: Any) -> RewardBatch:
        rewards: list[Reward] = []
        for start in range(0, len(requests), self.batch_size):
            end = start + self.batch_size
            rewards += self.model.score(requests[start:end], images[start:end])
        rewards = _renamed(rewards, self.name)
        return RewardBatch(rewards, count_statuses(rewards))


class JudgeTerm:
    """The VLM judge on prompt-image consistency: each image written as a PNG into `folder` and judged with
    `image_rewards.CONSISTENCY_QUESTION` (K verdicts, the judge's statuses and counts as they are)."""

    def __init__(self, judge: Any, folder: str | Path | None = None) -> None:
        self.judge, self.name = judge, judge.name
        self._owned = None if folder is not None else tempfile.mkdtemp(prefix="yatt-t2i-judge-")
        self.folder = Path(folder if folder is not None else self._owned)  # type: ignore[arg-type]
        self._calls = 0  # each call writes files of its own prefix: a slow reader never sees a newer image
        if self._owned is not None:  # removed with this object too (a host drops it without close())
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._owned, True)

    @property
    def failure_policy(self) -> dict[str, OnFailure]:
        return self.judge.failure_policy

    async def score_images(self, requests: Sequence[RewardRequest], images: Any) -> RewardBatch:
        from yatt_multimodal.image_rewards import consistency_requests

        self._calls += 1
        shutil.rmtree(self.folder / f"c{self._calls - 1}", ignore_errors=True)  # the previous call's PNGs
        asks = consistency_requests(
            [r.prompt for r in requests], images, self.folder / f"c{self._calls}", prefix="img"
        )
        batch = await self.judge.score(asks)
        rewards = [
            msgspec.structs.replace(reward, request_id=request.request_id)
            for reward, request in zip(batch.rewards, requests, strict=True)
        ]
        return RewardBatch(rewards, batch.metrics)

    def close(self) -> None:
        if self._owned is not None:
            self._cleanup()


class _Bound:
    """An image term as a `RewardFunction` over one call's images (what `CombinedReward` combines)."""

    def __init__(self, term: ImageRewardFunction, images: Any) -> None:
        self.term, self.images, self.name = term, images, term.name
        policy = getattr(term, "failure_policy", None)
        if policy is not None:
            self.failure_policy = policy

    async def score(self, requests: Sequence[RewardRequest]) -> RewardBatch:
        return await self.term.score_images(requests, self.images)


class CombinedImageReward:
    """`score = sum_i weight_i * score_i` over image terms (`CombinedReward`'s rules: a failed term adds
    nothing and gives the pair its status; judge counts add up). `failure_policy`: the strictest of the
    terms' (`CombinedReward.failure_policy`)."""

    def __init__(self, terms: Sequence[tuple[float, ImageRewardFunction]]) -> None:
        if not terms:
            raise ValueError("CombinedImageReward: terms is empty (rewards names no image reward)")
        self.terms = list(terms)
        self._policy = CombinedReward([(w, _Bound(t, None)) for w, t in self.terms])  # checks unique names

    @property
    def failure_policy(self) -> dict[str, OnFailure]:
        return self._policy.failure_policy

    async def score(self, requests: Sequence[RewardRequest], images: Any) -> RewardBatch:
        if len(requests) != len(images):
            raise ValueError(f"{len(requests)} reward requests but {len(images)} images")
        combined = CombinedReward([(w, _Bound(t, images)) for w, t in self.terms])
        return await combined.score(requests)

    def close(self) -> None:
        for _, term in self.terms:
            close = getattr(term, "close", None)
            if close is not None:
                close()


def _pixel_rule(spec: RewardSpec, resources: dict[str, Any]) -> ImageRewardFunction:
    if spec.options:
        raise ValueError(
            f"RewardSpec.options for 'colour_position': it takes none, got {sorted(spec.options)}"
        )
    return PixelRule(spec.name or spec.kind)


def _image_rm(spec: RewardSpec, resources: dict[str, Any]) -> ImageRewardFunction:
    (model,) = need(spec, resources, "image_rm")
    return RewardModelTerm(model, spec.name or spec.kind, int(spec.options.get("batch_size", 64)))


def _judge(spec: RewardSpec, resources: dict[str, Any]) -> ImageRewardFunction:
    from yatt_multimodal.genrm import GenRMJudge

    engine, codec = need(spec, resources, "engine", "codec")
    judge = GenRMJudge(
        engine, codec, spec.judge or JudgeSpec(), name=spec.name or "genrm", seed=resources.get("seed")
    )
    return JudgeTerm(judge, resources.get("folder"))


IMAGE_REWARDS: dict[str, Callable[[RewardSpec, dict[str, Any]], ImageRewardFunction]] = {
    "colour_position": _pixel_rule,
    "image_rm": _image_rm,
    "genrm": _judge,
}


def check_image_specs(specs: Sequence[RewardSpec], key: str = "rewards") -> None:
    """Every spec a registered image kind with known options; a ValueError naming `key[i]` otherwise."""
    if not specs:
        raise ValueError(f"{key} is empty: name at least one image reward, e.g. kind 'colour_position'")
    for i, spec in enumerate(specs):
        if spec.kind not in IMAGE_REWARDS:
            raise ValueError(
                f"{key}[{i}].kind {spec.kind!r} is not an image reward; known: {sorted(IMAGE_REWARDS)}"
            )
        unknown = sorted(set(spec.options) - set(RM_OPTIONS)) if spec.kind == "image_rm" else []
        if unknown:
            raise ValueError(
                f"{key}[{i}].options: unknown {unknown} for 'image_rm' (known: {list(RM_OPTIONS)})"
            )


def build_image_reward(spec: RewardSpec, **resources: Any) -> ImageRewardFunction:
    if spec.kind not in IMAGE_REWARDS:
        raise ValueError(
            f"RewardSpec.kind {spec.kind!r} is not an image reward; known: {sorted(IMAGE_REWARDS)}"
        )
    return IMAGE_REWARDS[spec.kind](spec, resources)


def build_combined_images(specs: Sequence[RewardSpec], **resources: Any) -> CombinedImageReward:
    """`sum_i spec_i.weight * score_i` over the image terms `specs` name."""
    check_image_specs(specs)
    return CombinedImageReward([(spec.weight, build_image_reward(spec, **resources)) for spec in specs])


def image_rm_from_options(options: dict[str, str], tokenizer: Any, *, image_size: int) -> Any:
    """The `image_rm` term's model: option `path` loads a saved one (`image_rewards.save_image_reward_model`);
    without it a tiny one is built from configs over `tokenizer` (options `width`, default 32, and `seed`,
    default 0), seeing images of `image_size` pixels."""
    from yatt_multimodal.image_rewards import load_image_reward_model, tiny_image_reward_model

    if options.get("path"):
        return load_image_reward_model(options["path"])
    return tiny_image_reward_model(
        tokenizer,
        image_size=image_size,
        width=int(options.get("width", 32)),
        seed=int(options.get("seed", 0)),
    )
