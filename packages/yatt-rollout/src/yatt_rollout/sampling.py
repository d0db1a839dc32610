"""Per-row token sampling for a batch whose rows carry different temperature, top-k, top-p and seeds.

Pure functions over logits `[B, V]`. The filters follow the usual definitions (top-k: keep the k largest
logits; top-p, nucleus sampling, Holtzman et al. 2020: keep the smallest prefix of the sorted distribution
whose mass reaches p, always at least one token). Temperature 0 is greedy (argmax of the raw logits).
Logprobs are the *raw* model distribution (`log_softmax` of the unprocessed logits), the same quantity vLLM
reports by default (`logprobs_mode="raw_logprobs"`) and the one a trainer recomputes from the model.

The per-row parameters live on the host (decisions such as "is every row greedy" never wait for the
device); the logits may live on any device, and the math runs there. Seeded rows' generators must be on
the logits' device.
"""

from __future__ import annotations

from typing import Any

import torch


def row_params(temperature: list[float], top_k: list[int], top_p: list[float]) -> dict[str, torch.Tensor]:
    """Per-row sampling parameters as tensors: temperature [B] f32, top_k [B] i64, top_p [B] f32."""
    return {
        "temperature": torch.tensor(temperature, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.long),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
    }


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. logits [B, V]; top_k [B] (0 = off);
    top_p [B] (1.0 = off). Ties at the k-th value are all kept."""
    if not bool((top_k > 0).any() or (top_p < 1).any()):
        return logits
    vocab, device = logits.shape[-1], logits.device
    top_k, top_p = top_k.to(device), top_p.to(device)
    sorted_logits, _ = logits.sort(dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(-1, (k - 1)[:, None])  # [B, 1]
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass strictly above each sorted position
    keep_sorted = mass_before < top_p[:, None]  # first position always kept (mass_before = 0 < p)
    # the smallest logit kept by top-p, per row
    cutoff = sorted_logits.masked_fill(~keep_sorted, float("inf")).min(-1, keepdim=True).values  # [B, 1]
    threshold = torch.maximum(kth, cutoff)
    return logits.masked_fill(logits < threshold, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: dict[str, torch.Tensor],
    generators: list[Any],
    default: torch.Generator,
) -> torch.Tensor:
    """Sample one token per row. logits [B, V] float32 (any device) -> tokens [B] int64 on that device.

    Rows with temperature 0 take the argmax; a row with its own `torch.Generator` (a seeded request) draws
    from it, so its tokens depend on its seed only; the other rows share the engine's `default` generator.
    """
    seeded = [g is not None for g in generators]
    return sample_from(logits, params, seeded, uniform_draws(generators) if any(seeded) else None, default)


def sample_from(
    logits: torch.Tensor,
    params: dict[str, torch.Tensor],
    seeded: list[bool],
    uniforms: torch.Tensor | None,
    default: torch.Generator,
) -> torch.Tensor:
    """`sample` with the seeded rows' uniform draws given: `uniforms` [B] float64 on the logits' device (read
    where `seeded`; None when no row is), each row's token the first whose cumulative probability exceeds
    its draw (`inverse_cdf`). `LiveRows` draws a row's uniforms for its whole budget at once."""
    temperature = params["temperature"]
    greedy = temperature == 0
    tokens = logits.argmax(-1)
    if bool(greedy.all()):
        return tokens
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.device)
    scaled = logits / divisor[:, None]
    probs = filter_logits(scaled, params["top_k"], params["top_p"]).softmax(-1)  # [B, V]
    greedy_rows = greedy.tolist()
    shared = [i for i, s in enumerate(seeded) if not s and not greedy_rows[i]]
    if len(shared) == len(seeded):  # the common case: one draw for the whole batch
        return torch.multinomial(probs, 1, generator=default)[:, 0]
    if shared:
        tokens[shared] = torch.multinomial(probs[shared], 1, generator=default)[:, 0]
    chosen = [i for i, s in enumerate(seeded) if s and not greedy_rows[i]]
    if chosen:
        assert uniforms is not None, "seeded rows need their uniform draws"
        if len(chosen) == len(seeded):  # every row seeded: no gather and scatter of rows
            return inverse_cdf(probs, uniforms)
        tokens[chosen] = inverse_cdf(probs[chosen], uniforms[chosen])
    return tokens


def uniform_draws(generators: list[Any], count: int | None = None) -> torch.Tensor:
    """One float64 uniform per generator ([R]), or `count` of them each ([R, count]), on the generators'
    device (0 for a None). A generator's draws come in order: on the CPU, `count` at once are the same
    numbers as `count` single draws."""
    shape = (1,) if count is None else (count,)
    device = next((g.device for g in generators if g is not None), torch.device("cpu"))
    out = torch.zeros((len(generators), *shape), dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(shape, generator=g, device=device, dtype=torch.float64)
    return out[:, 0] if count is None else out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V] from the row's uniform draw u [R] (float64): the first token whose
    cumulative probability (float64) exceeds u x the row's total, never a zero-probability token. A row's
    token depends on its draw and probabilities alone, as with a per-row `torch.multinomial`, for one
    vectorised search (the per-row multinomial loop cost 0.56 ms per decode step at 32 rows, this 0.06 ms)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    # strictly below the total (u x total may round up to it): the first cumulative value above the target
    # then always has a probability of its own, so no zero-probability token can be picked
    target = torch.minimum(u.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under the unprocessed model distribution. logits [B, V], tokens [B] -> [B] float32."""
    return logits.float().log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
