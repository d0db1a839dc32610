"""The rule reward of the embedded text-to-image task, computed from pixels: prompts name a colour and a half
of the image ("a red square on the left"), and the image scores by how much that colour dominates there.

Score of an RGB image for (colour, side): over the named half's pixels (values / 255), the mean of the named
colour's own channels minus the mean of the other channels, mapped from [-1, 1] to [0, 1]:

    score = (1 + mean(target channels) - mean(other channels)) / 2

A grey image scores 0.5, a pure red left half 1.0 for "red ... left", a pure green one 0.0. Secondary
colours count both their channels (yellow = red + green against blue). The score is dense and linear in the
pixels, so a tiny randomly initialised policy can climb it in minutes: the task is built to show learning,
not to judge images.
"""

from __future__ import annotations

import random
import re
from typing import Any

from yatt_multimodal.types import Reward, RewardRequest

__all__ = [
    "COLOURS",
    "SIDES",
    "colour_position_score",
    "colour_prompts",
    "parse_colour_prompt",
    "score_images",
]

# colour -> its RGB channels
COLOURS: dict[str, tuple[int, ...]] = {"red": (0,), "green": (1,), "blue": (2,), "yellow": (0, 1)}
SIDES = ("left", "right", "top", "bottom")
_PROMPT = re.compile(r"\b(" + "|".join(COLOURS) + r")\b.*\b(" + "|".join(SIDES) + r")\b", re.IGNORECASE)


def colour_prompts(num: int, *, seed: int) -> list[str]:
    """`num` prompts of the embedded task, "a {colour} square on the {side}", drawn uniformly with `seed`."""
    rng = random.Random(seed)
    return [f"a {rng.choice(list(COLOURS))} square on the {rng.choice(SIDES)}" for _ in range(num)]


def every_colour_prompt() -> list[str]:
    """Each (colour, side) pair of the task once, as its prompt: a balanced validation set (a small random draw
    over-weights some pairs, and the pairs are not equally hard)."""
    return [f"a {colour} square on the {side}" for colour in COLOURS for side in SIDES]


def parse_colour_prompt(prompt: str) -> tuple[str, str]:
    """(colour, side) named in `prompt`; ValueError when it names none of COLOURS then none of SIDES."""
    found = _PROMPT.search(prompt)
    if found is None:
        raise ValueError(
            f"prompt {prompt!r} names no colour of {list(COLOURS)} followed by a side of {list(SIDES)}"
        )
    return found.group(1).lower(), found.group(2).lower()


def _half(image: Any, side: str) -> Any:
    """The named half [h, w, 3] of an image [H, W, 3]."""
    height, width = image.shape[:2]
    halves = {
        "left": image[:, : width // 2],
        "right": image[:, width - width // 2 :],
        "top": image[: height // 2],
        "bottom": image[height - height // 2 :],
    }
    return halves[side]


def colour_position_score(image: Any, colour: str, side: str) -> float:
    """The module doc's score of a uint8 RGB image [H, W, 3] (numpy) for (colour, side), in [0, 1]."""
    import numpy as np

    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 RGB image [H, W, 3], got {image.dtype} {tuple(image.shape)}")
    region = _half(image, side).astype(np.float64) / 255.0
    target = COLOURS[colour]
    others = [c for c in range(3) if c not in target]
    return float((1.0 + region[..., list(target)].mean() - region[..., others].mean()) / 2.0)


def score_images(requests: list[RewardRequest], images: Any) -> list[Reward]:
    """One `Reward` per (request, image [H, W, 3]): the score of the request's prompt, or status `error` with
    the reason when the prompt names no colour and side (never a silent zero)."""
    out = []
    for request, image in zip(requests, images, strict=True):
        try:
            colour, side = parse_colour_prompt(request.prompt)
        except ValueError as err:
            out.append(Reward(request_id=request.request_id, score=0.0, status="error", error=str(err)))
            continue
        score = colour_position_score(image, colour, side)
        out.append(Reward(request_id=request.request_id, score=score, components={"colour_position": score}))
    return out
