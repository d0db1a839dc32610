"""tiny.py: locally trained tokenizers and config-built models, saved and reloaded offline."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from yatt_rollout.tiny import VISION_TOKENS, save_tiny, tiny_causal_lm, tiny_qwen2_vl, train_tokenizer  # noqa: E402

CORPUS = [f"{a} + {b} = {a + b}" for a in range(20) for b in range(20)]


def test_tokenizer_has_specials_and_chat_template():
    tok = train_tokenizer(CORPUS, vocab_size=300)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    # every byte is in the alphabet, so unseen text round-trips exactly
    assert tok.decode(tok.encode("héllo 12 + 7")) == "héllo 12 + 7"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1 + 1"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_tokenizer(CORPUS, vocab_size=100)


def test_tiny_model_is_seeded_and_reloads(tmp_path):
    tok = train_tokenizer(CORPUS, vocab_size=300)
    a, b = tiny_causal_lm(len(tok), seed=3), tiny_causal_lm(len(tok), seed=3)
    assert a.config.head_dim == 32 and a.config.num_hidden_layers == 2 and a.config.hidden_size == 64
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    path = save_tiny(a, tok, tmp_path / "m")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([tok.encode("3 + 4 =")])
    torch.testing.assert_close(loaded(ids).logits, a(ids).logits, rtol=0, atol=0)
    assert transformers.AutoTokenizer.from_pretrained(path).encode("3 + 4 =") == ids[0].tolist()


def test_tiny_model_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch must be one of"):
        tiny_causal_lm(300, arch="gpt5")


def test_tiny_qwen2_vl_needs_vision_tokens():
    with pytest.raises(ValueError, match="tokenizer lacks the vision tokens"):
        tiny_qwen2_vl(train_tokenizer(CORPUS, vocab_size=300))
    tok = train_tokenizer(CORPUS, vocab_size=300, extra_special_tokens=VISION_TOKENS)
    model, image_processor = tiny_qwen2_vl(tok)
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    # a 56x56 image is 4x4 patches of 14 px, merged 2x2 into 4 image tokens
    from PIL import Image

    grid = image_processor(images=[Image.new("RGB", (56, 56))], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]
