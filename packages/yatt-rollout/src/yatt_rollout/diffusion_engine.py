"""The diffusion rollout engine: samples a flow-matching text-to-image policy with the Flow-GRPO SDE and
returns, per image, the latents before and after every trained denoising step and that step's exact
log-probability (`yatt_algos.flow_grpo`), with the decoded image.

Each image draws its starting noise and every step's noise from its own generator seeded by its `seed`, so
an image is reproducible alone, whatever batch it rides in (a resumed run draws the same noise). Guidance
> 1 runs classifier-free guidance against the empty prompt: v = v_uncond + g (v_cond - v_uncond).
The engine beside the HF and vLLM ones: it takes weights by name (`load_weights`) like them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "DiffusionEngine",
    "DiffusionRollout",
    "DiffusionSampling",
    "decode_images",
    "encode_prompts",
    "train_step_indices",
    "velocity",
]


class DiffusionSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How images are sampled. Flow-GRPO's defaults for SD3.5 are 10 steps for training, eta 0.7; the
    original system's DiT trainer 16 steps, eta 0.3, shift 3."""

    num_steps: int = 16  # denoising steps per image
    eta: float = 0.3  # SDE noise level: 0 is the deterministic ODE (Euler) sampler
    shift: float = 3.0  # time shift of the sigma schedule (SD3's scheduler `shift`)
    guidance_scale: float = 1.0  # classifier-free guidance; 1 runs the conditional model only
    num_train_steps: int = 0  # the first K steps are trained (their transitions returned); 0: all
    image_size: int = 32  # pixels per side (a multiple of the VAE's scale x the transformer's patch)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1: no guidance), got {self.guidance_scale}")
        if not 0 <= self.num_train_steps <= self.num_steps:
            raise ValueError(
                f"num_train_steps must be in [0, num_steps={self.num_steps}], got {self.num_train_steps}"
            )


def train_step_indices(spec: DiffusionSampling) -> list[int]:
    """The denoising steps whose transitions are trained: the first `num_train_steps` (all when 0), the
    high-noise steps where the SDE explores most (Flow-GRPO's `timestep_fraction` keeps the first ones)."""
    return list(range(spec.num_train_steps or spec.num_steps))


@dataclass
class DiffusionRollout:
    """B images of one engine call. `latents` [B, K, C, h, w] are the inputs of the K trained steps,
    `next_latents` [B, K, C, h, w] their sampled outputs, `logprobs` [B, K] those transitions'
    log-probabilities, `sigmas` [K] and `next_sigmas` [K] their noise levels; `images` uint8 [B, H, W, 3];
    `embeds` [B, S, D] / `pooled` [B, P] the prompts' encodings (the learner conditions on the same);
    `policy_version` the weights that made them."""

    latents: Any
    next_latents: Any
    logprobs: Any
    sigmas: Any
    next_sigmas: Any
    images: Any
    embeds: Any
    pooled: Any
    policy_version: int = 0


def encode_prompts(policy: Any, prompts: Sequence[str]) -> tuple[Any, Any]:
    """(embeds [B, S, joint_dim], pooled [B, P]) of `prompts` through every CLIP encoder of `policy`: each
    prompt truncated to max_text_len - 1 tokens, then eos, then padding; the penultimate hidden states
    concatenated on features and zero-padded to the transformer's joint dim, pooled projections concatenated
    (as StableDiffusion3Pipeline)."""
    import torch

    hidden, pooled = [], []
    for enc, tok in zip(policy.text_encoders, policy.tokenizers, strict=True):
        length = policy.max_text_len
        rows = [
            [*tok(p, add_special_tokens=False)["input_ids"][: length - 1], tok.eos_token_id] for p in prompts
        ]
        ids = torch.tensor([r + [tok.pad_token_id] * (length - len(r)) for r in rows])
        with torch.no_grad():
            out = enc(input_ids=ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    embeds = torch.cat(hidden, dim=-1)
    joint = int(policy.transformer.config.joint_attention_dim)
    embeds = torch.nn.functional.pad(embeds, (0, joint - embeds.shape[-1]))
    return embeds, torch.cat(pooled, dim=-1)


def velocity(
    transformer: Any,
    latents: Any,
    sigma: float,
    cond: dict[str, Any],
    guidance_scale: float = 1.0,
) -> Any:
    """The transformer's velocity [B, C, h, w] at noise level `sigma` under `cond` (embeds, pooled and, for
    guidance > 1, neg_embeds / neg_pooled of the empty prompt, each [B, ...]); SD3's timestep is 1000 sigma."""
    import torch

    guided = guidance_scale > 1.0
    x = torch.cat([latents, latents]) if guided else latents
    embeds = torch.cat([cond["neg_embeds"], cond["embeds"]]) if guided else cond["embeds"]
    pooled = torch.cat([cond["neg_pooled"], cond["pooled"]]) if guided else cond["pooled"]
    t = torch.full((len(x),), sigma * 1000.0, dtype=latents.dtype)
    v = transformer(
        hidden_states=x,
        encoder_hidden_states=embeds,
        pooled_projections=pooled,
        timestep=t,
        return_dict=False,
    )[0]
    if not guided:
        return v
    v_uncond, v_cond = v.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def decode_images(policy: Any, latents: Any) -> Any:
    """uint8 images [B, H, W, 3] (numpy) of final latents [B, C, h, w] through the VAE (SD3's scaling)."""
    import torch

    cfg = policy.vae.config
    with torch.no_grad():
        pixels = policy.vae.decode(latents / cfg.scaling_factor + cfg.shift_factor, return_dict=False)[0]
    pixels = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).numpy()


class DiffusionEngine:
    """Samples `policy` (a `diffusion_models.T2IPolicy`) under `spec`; the transformer's weights can be
    replaced by name (`load_weights`), as the LLM engines take a learner's weights."""

    def __init__(self, policy: Any, spec: DiffusionSampling) -> None:
        from yatt_algos.flow_grpo import sigma_schedule

        side = spec.image_size
        unit = policy.vae_scale * int(policy.transformer.config.patch_size)
        if side % unit:
            raise ValueError(f"image_size {side} is not a multiple of {unit} (VAE scale x patch size)")
        self.policy, self.spec = policy, spec
        self.sigmas = sigma_schedule(spec.num_steps, spec.shift).tolist()
        self.policy_version = 0

    def conditioning(self, prompts: Sequence[str]) -> dict[str, Any]:
        """The prompts' encodings (and the empty prompt's, for guidance), each [B, ...]."""
        embeds, pooled = encode_prompts(self.policy, prompts)
        cond = {"embeds": embeds, "pooled": pooled}
        if self.spec.guidance_scale > 1.0:
            neg_embeds, neg_pooled = encode_prompts(self.policy, [""])
            cond["neg_embeds"] = neg_embeds.expand_as(embeds).contiguous()
            cond["neg_pooled"] = neg_pooled.expand_as(pooled).contiguous()
        return cond

    def _noise(self, generators: list[Any], shape: tuple[int, ...]) -> Any:
        import torch

        return torch.stack([torch.randn(shape, generator=g) for g in generators])

    def generate(self, prompts: Sequence[str], seeds: Sequence[int]) -> DiffusionRollout:
        """One image per (prompt, seed): the SDE path, the trained steps' transitions and log-probs."""
        import torch
        from yatt_algos.flow_grpo import sde_step

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        spec, sig = self.spec, self.sigmas
        side = spec.image_size // self.policy.vae_scale
        shape = (self.policy.latent_channels, side, side)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        cond = self.conditioning(prompts)
        x = self._noise(gens, shape)
        trained = train_step_indices(spec)
        inputs, outputs, logps = [], [], []
        with torch.no_grad():
            for k in range(spec.num_steps):
                v = velocity(self.policy.transformer, x, sig[k], cond, spec.guidance_scale)
                noise = self._noise(gens, shape)
                nxt, logp = sde_step(x, v, sig[k], sig[k + 1], eta=spec.eta, sigma_max=sig[1], noise=noise)
                if k in trained:
                    inputs.append(x)
                    outputs.append(nxt)
                    logps.append(logp)
                x = nxt
        return DiffusionRollout(
            latents=torch.stack(inputs, 1),
            next_latents=torch.stack(outputs, 1),
            logprobs=torch.stack(logps, 1),
            sigmas=torch.tensor([sig[k] for k in trained]),
            next_sigmas=torch.tensor([sig[k + 1] for k in trained]),
            images=decode_images(self.policy, x),
            embeds=cond["embeds"],
            pooled=cond["pooled"],
            policy_version=self.policy_version,
        )

    def load_weights(self, named: Sequence[tuple[str, Any]], version: int) -> None:
        """Copy the transformer's tensors by name (a learner's state) and record the policy version."""
        import torch

        params = dict(self.policy.transformer.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                if name not in params:
                    raise ValueError(f"weight {name!r} is not a parameter of the policy's transformer")
                params[name].copy_(tensor)
        self.policy_version = version
