"""The text-to-image policy's parts: an SD3-style flow-matching transformer (`SD3Transformer2DModel`), an
`AutoencoderKL` VAE and a CLIP text encoder with its tokenizer, as one `T2IPolicy` object.

`tiny_t2i(...)` builds all three from configs (nothing downloaded; the tokenizer is trained here on the
prompts, as `yatt_rollout.tiny` does for the tiny LLMs), `save_t2i` writes them as a diffusers folder
(`model_index.json` and one subfolder per part, the layout `StableDiffusion3Pipeline` reads), and `load_t2i`
reads such a folder: the tiny one or a real SD3-class pipeline (a hub id resolved to a folder by the caller).
Real SD3 folders hold two CLIP encoders and a T5; here the CLIP encoders are used (their penultimate hidden
states concatenated and zero-padded to the transformer's joint dimension, their pooled projections
concatenated, as `StableDiffusion3Pipeline` does) and T5, when present, is not loaded: the pipeline's own
`text_encoder_3=None` path, which SD3's authors support (their T5-free mode).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["T2IPolicy", "load_t2i", "save_t2i", "tiny_t2i"]

PIPELINE_CLASS = "StableDiffusion3Pipeline"


@dataclass
class T2IPolicy:
    """The transformer (trained), VAE and text encoders (frozen) of a text-to-image policy, with the
    VAE's latent scaling (latents = (vae latent - shift) x scale, as SD3)."""

    transformer: Any
    vae: Any
    text_encoders: list[Any]
    tokenizers: list[Any]
    max_text_len: int

    @property
    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell: 2 ** (VAE down blocks - 1)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def sample_size(self) -> int:
        """The image side (pixels) the transformer was configured for."""
        return int(self.transformer.config.sample_size) * self.vae_scale


def tiny_t2i(
    corpus: list[str],
    *,
    image_size: int = 32,
    latent_channels: int = 4,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    text_hidden: int = 32,
    max_text_len: int = 16,
    vae_steps: int = 0,
    seed: int = 0,
) -> T2IPolicy:
    """A tiny policy from configs: VAE with two blocks (latent side = image side / 2), a 2x2-patch SD3
    transformer over those latents, a CLIP text encoder (two layers of width `text_hidden`) and a ByteLevel
    BPE tokenizer trained on `corpus`. Weights are torch's default init under `seed`; then the VAE is
    trained `vae_steps` steps as an autoencoder on synthetic two-colour images (`pretrain_vae`): a random
    decoder maps latents to a narrow band of greys, which no policy can paint with."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from yatt_rollout.tiny import train_tokenizer

    if image_size % 4:
        raise ValueError(f"image_size must be a multiple of 4 (VAE /2, patch 2), got {image_size}")
    torch.manual_seed(seed)
    tok = train_tokenizer(corpus, vocab_size=320)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        mid_block_add_attention=False,  # tiny: convolutions only (attention buys nothing at 16x16 latents)
        sample_size=image_size,
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    text = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=max_text_len,
            projection_dim=text_hidden,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.pad_token_id,
        )
    )
    transformer = SD3Transformer2DModel(
        sample_size=image_size // 2,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=hidden_size // num_heads,
        num_attention_heads=num_heads,
        joint_attention_dim=text_hidden,
        caption_projection_dim=hidden_size,
        pooled_projection_dim=text_hidden,
        pos_embed_max_size=image_size // 4,
    )
    if vae_steps:
        pretrain_vae(vae, image_size, num_steps=vae_steps, seed=seed)
    parts: tuple[Any, ...] = (transformer, vae, text)  # diffusers' lazy-import stubs hide nn.Module.eval
    for part in parts:
        part.eval()
    return T2IPolicy(transformer, vae, [text], [tok], max_text_len)


def two_colour_images(num: int, size: int, generator: Any) -> Any:
    """`num` images [num, 3, size, size] in [-1, 1]: two uniform random colours split at a random column or
    row (the layouts a prompt of the embedded task asks for), the VAE's pretraining data."""
    import torch

    first = torch.rand(num, 3, 1, 1, generator=generator) * 2 - 1
    second = torch.rand(num, 3, 1, 1, generator=generator) * 2 - 1
    cut = torch.randint(size // 4, size - size // 4 + 1, (num, 1, 1, 1), generator=generator)
    along = torch.arange(size)
    columns = along.view(1, 1, 1, size) >= cut
    rows = along.view(1, 1, size, 1) >= cut
    vertical = torch.rand(num, 1, 1, 1, generator=generator) < 0.5
    mask = torch.where(vertical, columns.expand(num, 1, size, size), rows.expand(num, 1, size, size))
    return torch.where(mask, second, first)


def pretrain_vae(vae: Any, size: int, *, num_steps: int, seed: int, batch_size: int = 16) -> float:
    """Train `vae` in place as an autoencoder (MSE + 1e-3 KL per latent element, Adam 3e-3) on
    `two_colour_images`; returns the last reconstruction MSE."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=3e-3)
    vae.train()
    mse = float("nan")
    for _ in range(num_steps):
        images = two_colour_images(batch_size, size, gen)
        posterior = vae.encode(images).latent_dist
        recon = vae.decode(posterior.sample(generator=gen)).sample
        loss = ((recon - images) ** 2).mean()
        mse = float(loss.detach())
        (loss + 1e-3 * posterior.kl().mean() / posterior.mean[0].numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    vae.eval()
    return mse


def save_t2i(policy: T2IPolicy, path: str | Path) -> Path:
    """Write `policy` as a diffusers folder (model_index.json, transformer/, vae/, text_encoder/,
    tokenizer/, scheduler/); written to PATH.tmp and renamed, so a half-written folder is never read."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    policy.transformer.save_pretrained(tmp / "transformer")
    policy.vae.save_pretrained(tmp / "vae")
    index: dict[str, Any] = {
        "_class_name": PIPELINE_CLASS,
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    suffixes = ["", "_2"]
    for i, (enc, tok) in enumerate(zip(policy.text_encoders, policy.tokenizers, strict=True)):
        enc.save_pretrained(tmp / f"text_encoder{suffixes[i]}")
        tok.save_pretrained(tmp / f"tokenizer{suffixes[i]}")
        index[f"text_encoder{suffixes[i]}"] = ["transformers", "CLIPTextModelWithProjection"]
        index[f"tokenizer{suffixes[i]}"] = ["transformers", "PreTrainedTokenizerFast"]
    scheduler: Any = FlowMatchEulerDiscreteScheduler(shift=3.0)  # its ConfigMixin is invisible to mypy
    scheduler.save_pretrained(tmp / "scheduler")
    (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def load_t2i(path: str | Path, *, dtype: Any = None) -> T2IPolicy:
    """The policy in diffusers folder `path` (a tiny one from `save_t2i`, or an SD3-class pipeline: its CLIP
    encoders, see the module doc). ValueError naming the folder and the missing part otherwise."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    root = Path(path)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ValueError(f"{root}: no model_index.json (not a diffusers pipeline folder)")
    index = json.loads(index_file.read_text())
    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        if part not in index or not (root / part).is_dir():
            raise ValueError(
                f"{root}: the pipeline has no {part}/ (a flow-matching SD3-style pipeline needs it)"
            )
    dtype = dtype or torch.float32
    transformer = SD3Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype)
    vae = AutoencoderKL.from_pretrained(root / "vae", torch_dtype=dtype)
    encoders, tokenizers = [], []
    for suffix in ("", "_2"):
        if f"text_encoder{suffix}" in index and (root / f"text_encoder{suffix}").is_dir():
            enc = CLIPTextModelWithProjection.from_pretrained(
                root / f"text_encoder{suffix}", torch_dtype=dtype
            )
            encoders.append(enc.eval())
            tokenizers.append(AutoTokenizer.from_pretrained(root / f"tokenizer{suffix}"))
    max_len = min(int(e.config.max_position_embeddings) for e in encoders)
    return T2IPolicy(transformer.eval(), vae.eval(), encoders, tokenizers, max_len)
