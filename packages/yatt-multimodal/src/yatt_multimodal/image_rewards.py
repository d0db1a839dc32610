"""Image rewards beside the pixel rule (`image_rules`): a CLIP-style Bradley-Terry image reward model, and the
requests that let the existing VLM judge (`genrm.GenRMJudge` with `vlm.QwenVLCodec`) score prompt-image
consistency of generated images.

The reward model (as ImageReward, Xu et al. 2023, arXiv 2304.05977, and PickScore, arXiv 2305.01569): a CLIP
vision tower and text tower, their projected embeddings, and a linear head on [image, text, image * text]
giving one scalar r(prompt, image); trained on preference pairs with the Bradley-Terry loss
-log sigmoid(r_chosen - r_rejected). `tiny_image_reward_model` builds one from configs (nothing downloaded),
`ImageRewardModel.from_clip` wraps a real `CLIPModel` (loaded by the caller from a folder or hub id).
Needs torch and transformers (yatt-rollout's extra "hf") and pillow to write PNGs (extra "vision").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from yatt_multimodal.types import Reward, RewardRequest

__all__ = [
    "ImageRewardModel",
    "bradley_terry_loss",
    "consistency_requests",
    "load_image_reward_model",
    "save_image_reward_model",
    "tiny_image_reward_model",
]

RM_FILES = ("clip", "tokenizer", "head.safetensors")  # a saved reward model's folder

CONSISTENCY_QUESTION = "Does the image match the description: {prompt}? Answer Yes or No."


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean -log sigmoid(r_chosen - r_rejected) over pairs, rewards [B] each."""
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


class ImageRewardModel(torch.nn.Module):
    """r(prompt, image) from a CLIPModel's projected image and text embeddings (unit-normalised) through a
    linear head on [img, txt, img * txt]. `tokenizer` encodes prompts (eos appended, padded to the text
    tower's positions); images are uint8 [B, H, W, 3], resized to the vision tower's side and scaled to
    [-1, 1]."""

    def __init__(self, clip: Any, tokenizer: Any) -> None:
        super().__init__()
        self.clip, self.tokenizer = clip, tokenizer
        dim = int(clip.config.projection_dim)
        self.head = torch.nn.Linear(3 * dim, 1)
        self.side = int(clip.config.vision_config.image_size)
        self.max_len = int(clip.config.text_config.max_position_embeddings)

    @classmethod
    def from_clip(cls, clip: Any, tokenizer: Any) -> ImageRewardModel:
        return cls(clip, tokenizer)

    def _pixels(self, images: Any) -> torch.Tensor:
        pixels = torch.as_tensor(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [B, 3, H, W]
        if pixels.shape[-1] != self.side or pixels.shape[-2] != self.side:
            pixels = torch.nn.functional.interpolate(pixels, size=(self.side, self.side), mode="bilinear")
        return pixels

    def _ids(self, prompts: Sequence[str]) -> torch.Tensor:
        tok, length = self.tokenizer, self.max_len
        rows = [
            [*tok(p, add_special_tokens=False)["input_ids"][: length - 1], tok.eos_token_id] for p in prompts
        ]
        return torch.tensor([r + [tok.pad_token_id] * (length - len(r)) for r in rows])

    def forward(self, prompts: Sequence[str], images: Any) -> torch.Tensor:
        """Rewards [B] of (prompt, image) pairs."""
        if len(prompts) != len(images):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} images")
        img = self.clip.get_image_features(pixel_values=self._pixels(images))
        txt = self.clip.get_text_features(input_ids=self._ids(prompts))
        img = _features(img)
        txt = _features(txt)
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        return self.head(torch.cat([img, txt, img * txt], dim=-1))[:, 0]

    @torch.no_grad()
    def score(self, requests: Sequence[RewardRequest], images: Any) -> list[Reward]:
        """One `Reward` per (request, image): r(request.prompt, image) as `score` and component `image_rm`."""
        values = self.eval()([r.prompt for r in requests], images).tolist()
        return [
            Reward(request_id=r.request_id, score=float(v), components={"image_rm": float(v)})
            for r, v in zip(requests, values, strict=True)
        ]


def _features(out: Any) -> torch.Tensor:
    """transformers 5 returns a model output from get_*_features; older versions the tensor itself."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def tiny_image_reward_model(
    tokenizer: Any, *, image_size: int = 16, width: int = 32, seed: int = 0
) -> ImageRewardModel:
    """A tiny CLIP (two-layer vision tower on 4x4 patches, two-layer text tower, width `width`) from configs,
    over `tokenizer` (eos and pad ids taken from it), with the reward head; weights torch's init under `seed`."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    torch.manual_seed(seed)
    tower: dict[str, Any] = {
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    text = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=16,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        **tower,
    )
    vision = CLIPVisionConfig(image_size=image_size, patch_size=4, **tower)
    clip = CLIPModel(
        CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=width)
    )
    return ImageRewardModel(clip, tokenizer)


def save_image_reward_model(model: ImageRewardModel, folder: str | Path) -> Path:
    """`folder` holding `model`: clip/ (the CLIPModel's save_pretrained), tokenizer/, head.safetensors.
    Written to FOLDER.tmp and renamed, so a half-written folder is never loaded."""
    import shutil

    from safetensors.torch import save_file

    out = Path(folder)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.clip.save_pretrained(tmp / "clip")
    model.tokenizer.save_pretrained(tmp / "tokenizer")
    save_file({k: v.contiguous() for k, v in model.head.state_dict().items()}, tmp / "head.safetensors")
    tmp.rename(out)
    return out


def load_image_reward_model(folder: str | Path) -> ImageRewardModel:
    """The reward model `save_image_reward_model` wrote to `folder` (local files only); a ValueError naming
    the folder and what it lacks otherwise."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPModel

    root = Path(folder)
    missing = [name for name in RM_FILES if not (root / name).exists()]
    if missing:
        raise ValueError(
            f"{root} is not a saved image reward model (save_image_reward_model): it lacks {missing}"
        )
    clip = CLIPModel.from_pretrained(root / "clip", local_files_only=True)
    model = ImageRewardModel(clip, AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True))
    model.head.load_state_dict(load_file(root / "head.safetensors"))
    return model.eval()


def consistency_requests(
    prompts: Sequence[str], images: Any, folder: str | Path, *, prefix: str = "img"
) -> list[RewardRequest]:
    """Judge requests for the VLM judge, one per (prompt, image): each image written as PNG into `folder`
    (media travel by reference, never inline) and asked about as CONSISTENCY_QUESTION; the response is empty
    (the judge reads the image against the question)."""
    from PIL import Image
    from yatt_rollout.types import MediaRef

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (prompt, image) in enumerate(zip(prompts, images, strict=True)):
        path = root / f"{prefix}-{i}.png"
        Image.fromarray(image).save(path)
        out.append(
            RewardRequest(
                request_id=f"{prefix}-{i}",
                prompt=CONSISTENCY_QUESTION.format(prompt=prompt),
                response="",
                media=[MediaRef(kind="image", uri=str(path))],
                metadata={"t2i_prompt": prompt},
            )
        )
    return out
