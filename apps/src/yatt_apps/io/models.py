"""Model directories for a run: a user's HF directory as is, or a tiny model built from `ModelSpec` with a
tokenizer trained locally on the task's text, written once into the run directory so that every worker loads
the same weights (`from_pretrained` offline). Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from yatt_apps.config import ModelSpec
from yatt_apps.io.data import PromptRow


def tokenizer_corpus(rows: Iterable[PromptRow], extra: Iterable[str] = ()) -> list[str]:
    """The text a tiny tokenizer is trained on: every prompt and answer, and any template text."""
    texts = [f"{row.prompt} {row.answer}" for row in rows]
    return texts + list(extra)


def prepare_model(spec: ModelSpec, out: Path, corpus: list[str], *, key: str = "model.path") -> Path:
    """The HF directory of `spec`: `spec.path` if given (checked), else a tiny model written to `out`
    (reused when it is already there, as on resume)."""
    if spec.path:  # a local folder or a hub id (cached snapshot, else downloaded unless offline)
        from yatt_apps.io.model_sources import resolve_model_dir

        return resolve_model_dir(spec.path, key=key)
    if (out / "config.json").is_file():
        return out
    if spec.arch == "qwen2_vl":
        return _prepare_tiny_vlm(spec, out, corpus)
    if spec.warm_start != "none" and spec.warm_start_steps:  # trained briefly on the embedded task, cached
        from yatt_apps.runtime.warmstart import cached_or_build, extra_corpus, extra_tokens

        corpus = corpus + extra_corpus(spec)
        return cached_or_build(spec, out, corpus, lambda: tiny_text_model(spec, corpus, extra_tokens(spec)))
    from yatt_rollout.tiny import save_tiny

    model, tok = tiny_text_model(spec, corpus)
    tmp = out.with_name(out.name + ".tmp")
    save_tiny(model, tok, tmp)
    tmp.replace(out)  # a half-written model directory is never taken for a complete one
    return out


def tiny_text_model(spec: ModelSpec, corpus: list[str], extra_tokens: Sequence[str] = ()) -> Any:
    """(model, tokenizer) of a tiny text model built from `spec`, its tokenizer trained on `corpus`, plus
    `extra_tokens` as whole (never split) tokens."""
    from yatt_rollout.tiny import tiny_causal_lm, train_tokenizer

    tok = train_tokenizer(corpus, vocab_size=spec.vocab_size)
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    model = tiny_causal_lm(
        len(tok),
        arch=spec.arch,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        seed=spec.seed,
        max_position_embeddings=spec.max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return model, tok


def _prepare_tiny_vlm(spec: ModelSpec, out: Path, corpus: list[str]) -> Path:
    """A tiny Qwen2-VL (vision tower included) with a tokenizer that has the vision tokens and the image
    processor beside it, written atomically like the text models."""
    from yatt_rollout.tiny import VISION_TOKENS, save_tiny, tiny_qwen2_vl, train_tokenizer

    tok = train_tokenizer(corpus, vocab_size=spec.vocab_size, extra_special_tokens=VISION_TOKENS)
    model, processor = tiny_qwen2_vl(
        tok,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        seed=spec.seed,
    )
    tmp = out.with_name(out.name + ".tmp")
    save_tiny(model, tok, tmp)
    processor.save_pretrained(tmp)
    tmp.replace(out)
    return out


def is_vlm(path: str | Path) -> bool:
    """Whether the HF directory holds a vision-language model (it has an image processor config)."""
    return (Path(path) / "preprocessor_config.json").is_file()


def load_causal_lm(path: str | Path, *, trust_remote_code: bool = False, dtype: str = "float32") -> Any:
    """An HF causal LM (or an image-text-to-text VLM) on CPU in `dtype` (a torch dtype name), from a local
    directory only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vlm(path) else AutoModelForCausalLM
    return auto.from_pretrained(
        str(path), dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=trust_remote_code
    )


def load_image_processor(path: str | Path) -> Any:
    """The image processor saved beside a VLM (the PIL one: torchvision is deliberately absent)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(path), local_files_only=True)


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )
