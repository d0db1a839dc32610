"""Model directories for a run: a user's HF directory as is, or a tiny model built from `ModelSpec` with a
tokenizer trained locally on the task's text, written once into the run directory so that every worker loads
the same weights (`from_pretrained` offline). Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from yatt_apps.config import ModelSpec


def tokenizer_corpus(rows: Iterable[object], extra: Iterable[str] = ()) -> list[str]:
    """The text a tiny tokenizer is trained on: every prompt and answer, and any template text."""
    texts = [f"{row.prompt} {row.answer}" for row in rows]
    return texts + list(extra)


def prepare_model(spec: ModelSpec, out: Path, corpus: list[str]) -> Path:
    """The HF directory of `spec`: `spec.path` if given (checked), else a tiny model written to `out`
    (reused when it is already there, as on resume)."""
    if spec.path:
        path = Path(spec.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path {spec.path!r} is not an HF model directory (no config.json)")
        return path
    if (out / "config.json").is_file():
        return out
    from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer

    tok = train_tokenizer(corpus, vocab_size=spec.vocab_size)
    model = tiny_causal_lm(
        len(tok), arch=spec.arch, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, seed=spec.seed,
        max_position_embeddings=spec.max_position_embeddings, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    tmp = out.with_name(out.name + ".tmp")
    save_tiny(model, tok, tmp)
    tmp.replace(out)  # a half-written model directory is never taken for a complete one
    return out


def load_causal_lm(path: str | Path, *, trust_remote_code: bool = False):
    """An HF causal LM in float32 on CPU, from a local directory only."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True, trust_remote_code=trust_remote_code
    )


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )
