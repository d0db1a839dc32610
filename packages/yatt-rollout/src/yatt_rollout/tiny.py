"""Tiny models and tokenizers for CPU runs and tests, built from configs: nothing is ever downloaded.

`train_tokenizer` trains a ByteLevel BPE on a local corpus (milliseconds) and wraps it as a
`PreTrainedTokenizerFast` with eos/pad tokens and a ChatML chat template; `tiny_causal_lm` builds a
randomly initialized Llama/Qwen2, or a Qwen3-MoE (a few experts, top-k 2: the mixture-of-experts policy that
routing replay is tested on), from a config; `tiny_qwen2_vl` builds a Qwen2-VL model and its processor
(pillow, no torchvision); `save_tiny` writes an HF directory that `from_pretrained` and vLLM load.
vLLM's CPU attention needs head_dim in {32, 64, 80, ...}, hence the default `head_dim=32`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# ChatML, the format of the Qwen family; `add_generation_prompt` opens the assistant turn. Tools as Qwen2.5's
# template renders them: `apply_chat_template(..., tools=[...])` puts the JSON schemas in the system turn (after
# the system message's text, if any), an assistant message's `tool_calls` become `<tool_call>` blocks and
# consecutive `tool` messages one user turn of `<tool_response>` blocks. Conversations without tools, tool
# calls or tool messages render exactly as plain ChatML did (`LEGACY_CHAT_TEMPLATE`): every other job's
# prompts (and the cached warm-started models trained on them) are unchanged.
LEGACY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_HEADER) + " }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + repr(TOOLS_FOOTER) + " + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call.get('function') %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Placeholders of the Qwen2-VL family: an image is `<|vision_start|><|image_pad|>...<|vision_end|>`.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2's pre-tokenizer split (digits one by one, words, punctuation runs): with it, the directory that
# `save_tiny` writes loads through `AutoTokenizer` (which picks `Qwen2Tokenizer` for qwen2 models) and
# encodes exactly as the trained tokenizer does.
SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def train_tokenizer(
    corpus: Iterable[str],
    *,
    vocab_size: int = 512,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
) -> Any:
    """Train a ByteLevel BPE tokenizer on `corpus` and wrap it as a `PreTrainedTokenizerFast`.

    eos is `<|im_end|>` (the end of a chat turn), pad is `<|endoftext|>`; `chat_template` defaults to ChatML.
    `extra_special_tokens` (e.g. `VISION_TOKENS`) become single, never-split tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS]
    if vocab_size < len(specials) + 256:
        raise ValueError(
            f"vocab_size must be >= {len(specials) + 256} (256 bytes + specials), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no <unk> at run time
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in specials if t not in ("<unk>", "<|im_end|>", "<|endoftext|>")],
    )
    wrapped.chat_template = chat_template if chat_template is not None else DEFAULT_CHAT_TEMPLATE
    return wrapped


TEXT_ARCHS = ("qwen2", "llama", "qwen3_moe")
# the mixture-of-experts shape of a tiny Qwen3-MoE: every layer sparse, 4 experts of which 2 run per token
MOE_DEFAULTS = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True}


def _llama_family(arch: str) -> tuple[Any, Any]:
    import transformers

    families = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    }
    if arch not in families:
        raise ValueError(f"arch must be one of {sorted(families)}, got {arch!r}")
    config_name, model_name = families[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def tiny_causal_lm(
    vocab_size: int,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    seed: int = 0,
    **config: Any,
) -> Any:
    """A randomly initialized causal LM (`arch` in `TEXT_ARCHS`) in float32 eval mode.

    "qwen3_moe" is a Qwen3-MoE whose every layer is a sparse MoE block (`MOE_DEFAULTS`: 4 experts, top-k 2,
    each expert's width `moe_intermediate_size` = hidden_size). `config` overrides any field of the HF config
    (e.g. `max_position_embeddings`, `tie_word_embeddings`, `num_experts`). The same `seed` gives the same
    weights.
    """
    import torch

    config_cls, model_cls = _llama_family(arch)
    fields = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    if arch == "qwen3_moe":
        fields |= {**MOE_DEFAULTS, "moe_intermediate_size": hidden_size}
    fields.update(config)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields))
    return model.float().eval()


def tiny_qwen2_vl(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vision_depth: int = 1,
    vision_embed_dim: int = 32,
    seed: int = 0,
    max_pixels: int = 56 * 56,
) -> tuple[Any, Any]:
    """A tiny Qwen2-VL (`Qwen2VLForConditionalGeneration`) and its image processor, for a tokenizer trained
    with `extra_special_tokens=VISION_TOKENS`. Images are resized to at most `max_pixels` (56x56: 4 patches
    of 14 px per side, merged 2x2 into 4 image tokens).

    The image processor, not `Qwen2VLProcessor`: in transformers 5 the full processor insists on a video
    processor, which needs torchvision (deliberately absent). Prompts carry one `<|image_pad|>` per image
    and `HFEngine` expands it to the image's token count.
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    if any(i is None or i == tokenizer.unk_token_id for i in ids.values()):
        raise ValueError(
            f"tokenizer lacks the vision tokens {VISION_TOKENS}; train it with extra_special_tokens"
        )
    head_dim = hidden_size // num_heads
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 1024,
        # M-RoPE splits head_dim/2 rotary frequencies into temporal, height, width sections
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope(head_dim)},
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "depth": vision_depth,
        "embed_dim": vision_embed_dim,
        "hidden_size": hidden_size,
        "num_heads": 2,
        "mlp_ratio": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).float().eval()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels)
    return model, image_processor


def _mrope(head_dim: int) -> list[int]:
    # temporal gets the remainder; height and width a quarter of the head_dim/2 frequencies each
    quarter = head_dim // 8
    return [head_dim // 2 - 2 * quarter, quarter, quarter]


def save_tiny(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Write `model` (safetensors + config + generation config) and `tokenizer` (or a processor) to `path`,
    an HF model directory that `from_pretrained` and vLLM's `LLM(model=path)` load offline."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
