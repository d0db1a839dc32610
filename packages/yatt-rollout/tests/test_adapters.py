"""LoRA adapter-only sync into the HF engine (`adapters.py`): after a sync of peft's adapter tensors the
engine's logits equal those of the merged model, only the adapter's bytes crossed (>= 10x fewer than the full
model's on the tiny model), a second sync replaces the first (not stacked), and bad tensors are named."""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from yatt_rollout.adapters import adapter_pairs, nbytes  # noqa: E402
from yatt_rollout.hf_engine import HFEngine  # noqa: E402
from yatt_rollout.tiny import tiny_causal_lm  # noqa: E402

IDS = torch.tensor([[5, 9, 17, 3, 44, 8]])


def _trained_adapter(base, seed):
    """A peft LoRA (r 4 on q/v/up projections) with random B (peft starts B at 0): (merged model, adapter
    tensors by peft name, scaling)."""
    model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    named = list(peft.get_peft_model_state_dict(model).items())
    return model.merge_and_unload().eval(), named, 8 / 4


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_adapter_sync_gives_the_merged_models_logits_with_only_adapter_bytes():
    base = tiny_causal_lm(96, seed=0)
    engine = HFEngine(copy.deepcopy(base), max_batch_size=2)
    try:
        full = nbytes(engine.model.named_parameters())
        for seed in (1, 2):  # the second sync replaces the first: W = W0 + s * B2 @ A2, not W0 + both
            merged, named, scaling = _trained_adapter(base, seed)
            received = engine.load_adapter(named, scaling=scaling, version=seed)
            torch.testing.assert_close(_logits(engine.model), _logits(merged), rtol=0, atol=1e-5)
            assert engine.policy_version == seed
            assert received == sum(t.numel() * 4 for _, t in named)
            assert all(".lora_A." in n or ".lora_B." in n for n, _ in named)
            assert full / received >= 10, (full, received)
        # a full load of a layer makes it that layer's base: a later adapter applies on top of it
        q = "model.layers.0.self_attn.q_proj.weight"
        new_q = torch.randn_like(dict(base.named_parameters())[q])
        engine.load_weights([(q, new_q)], version=3)
        engine.load_adapter(named, scaling=scaling, version=4)
        a, b = adapter_pairs(named)[q]
        torch.testing.assert_close(
            dict(engine.model.named_parameters())[q].detach(), new_q + scaling * b @ a, rtol=0, atol=1e-6
        )
    finally:
        engine.close()


def test_bad_adapter_tensors_are_named():
    engine = HFEngine(tiny_causal_lm(96, seed=0), max_batch_size=1)
    try:
        with pytest.raises(
            ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' is not a LoRA factor"
        ):
            engine.load_adapter(
                [("model.layers.0.mlp.up_proj.weight", torch.zeros(1))], scaling=1.0, version=1
            )
        with pytest.raises(ValueError, match="has only \\['lora_A'\\]"):
            engine.load_adapter(
                [("model.layers.0.mlp.up_proj.lora_A.weight", torch.zeros(4, 64))], scaling=1.0, version=1
            )
        a, b = torch.zeros(4, 64), torch.zeros(7, 4)
        with pytest.raises(ValueError, match="gives B @ A of \\(7, 64\\)"):
            engine.load_adapter(
                [
                    ("model.layers.0.mlp.up_proj.lora_A.weight", a),
                    ("model.layers.0.mlp.up_proj.lora_B.weight", b),
                ],
                scaling=1.0,
                version=1,
            )
        assert engine.policy_version == 0  # nothing was applied
    finally:
        engine.close()
