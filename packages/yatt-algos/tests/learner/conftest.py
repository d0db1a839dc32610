"""Shared setup of the learner tests: tiny HF models built from configs (hidden 64, 2 layers) and
generated batches. Nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
from yatt_algos.learner.megatron_cpu_shim import megatron_cpu_shim  # TEST-ONLY shim


def tiny_config(kind: str = "qwen2", **overrides):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[kind]
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    return cls(**(fields | overrides))


def tiny_lm(seed: int = 0, kind: str = "qwen2", **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)


def tiny_critic(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    return AutoModelForTokenClassification.from_config(
        tiny_config(num_labels=1, classifier_dropout=0.0), dtype=torch.float32
    )


def make_batch(seed: int = 0, num_seqs: int = 8, max_len: int = 24) -> dict[str, torch.Tensor]:
    """Right-padded sequences of uneven lengths: a prompt of 3-6 tokens then a response to the full length."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, max_len + 1, (num_seqs,), generator=g)
    prompts = torch.randint(3, 7, (num_seqs,), generator=g)
    pos = torch.arange(max_len)
    attention = pos[None] < lengths[:, None]
    response = attention & (pos[None] >= prompts[:, None])
    ids = torch.randint(1, 128, (num_seqs, max_len), generator=g) * attention
    seq_adv = torch.randn(num_seqs, generator=g)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "response_mask": response,
        "old_logprobs": torch.where(response, -4.0 + 0.3 * torch.randn(num_seqs, max_len, generator=g), 0.0),
        "advantages": torch.where(response, seq_adv[:, None].expand(-1, max_len), 0.0),
        "ref_logprobs": torch.where(response, -4.0 + 0.3 * torch.randn(num_seqs, max_len, generator=g), 0.0),
        "returns": torch.where(response, torch.randn(num_seqs, max_len, generator=g), 0.0),
        "old_values": torch.where(response, 0.1 * torch.randn(num_seqs, max_len, generator=g), 0.0),
    }


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread while these tests run: tiny models gain nothing from more, and on a shared 2-core
    machine two spinning threads per process made steps 100x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return make_batch()


@pytest.fixture(scope="session")
def tiny():
    """The helpers above, for tests (conftest modules are not importable under --import-mode=importlib)."""
    import types

    return types.SimpleNamespace(
        config=tiny_config,
        lm=tiny_lm,
        critic=tiny_critic,
        batch=make_batch,
        params=params_of,
        diff=max_diff,
        dp_batch=dp_batch,
        dp_algo=DP_ALGO,
        dp_optim=DP_OPTIM,
        megatron_cpu_shim=megatron_cpu_shim,
        init_megatron=init_megatron,
        free_port=free_port,
    )


def _dp_configs():
    from yatt_algos.types import AlgoConfig, OptimConfig

    # eps 1e-6: see test_learner_torch.OPTIM (the key-bias gradient is float noise that Adam would amplify)
    return (
        AlgoConfig(loss_agg_mode="seq-mean-token-mean", kl_loss_coef=0.05),
        OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=2, clip_grad_norm=1.0),
    )


DP_ALGO, DP_OPTIM = _dp_configs()


def dp_batch() -> dict[str, torch.Tensor]:
    """The global batch of the data-parallel tests: 8 sequences, old logprobs near the model's."""
    batch = make_batch(seed=3)
    with torch.no_grad():
        logits = tiny_lm(0)(input_ids=batch["input_ids"]).logits[:, :-1]
        picked = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    g = torch.Generator().manual_seed(4)
    old = torch.nn.functional.pad(picked, (1, 0)) + 0.2 * torch.randn(
        picked.shape[0], picked.shape[1] + 1, generator=g
    )
    batch["old_logprobs"] = torch.where(batch["response_mask"], old, 0.0)
    return batch


def init_megatron(rank: int, world: int, port: int, *, tp: int = 1, pp: int = 1) -> bool:
    """A gloo process group on 127.0.0.1 and Megatron's parallel state over it (the caller owns both). A
    one-process world reuses a default group the process already has (an in-process vLLM engine, run earlier
    in the same test worker, leaves one behind). Returns whether it made the process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    made = not (world == 1 and dist.is_initialized() and dist.get_world_size() == 1)
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return made


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
