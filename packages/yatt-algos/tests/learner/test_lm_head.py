"""The chunked output head (`learner/lm_head.py`) against the full-logits path: log-probs, entropy and every
parameter's gradient equal to 1e-5 in fp32 on tiny Qwen2 and Llama (several chunks, a temperature, padding);
Gemma 2's softcapping is applied; an unknown model type falls back to the full logits with a warning."""

from __future__ import annotations

import pytest
import torch
from yatt_algos.learner.lm_head import LogitTransform, chunked_head
from yatt_algos.learner.torch_backend import causal_lm_forward, token_outputs

from .conftest import tiny_lm


def _batch(vocab: int, b: int = 3, t: int = 11) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([t, t - 3, t - 5])[:b]
    mask = torch.arange(t)[None] < lengths[:, None]
    return {"input_ids": torch.randint(0, vocab, (b, t), generator=g) * mask, "attention_mask": mask}


def _naive(model, mb, temperature):
    logits = model(
        input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long(), use_cache=False
    ).logits
    return token_outputs(logits, mb, chunk_size=4, temperature=temperature, entropy="grad")


def _loss_and_grads(model, out):
    # a loss touching both outputs with different weights, so each one's gradient counts
    loss = (out["logprobs"] * 0.7).sum() + (out["entropy"] * 1.3).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("llama", False), ("qwen2", True)])
def test_chunked_head_equals_full_logits(kind, tie):
    model = tiny_lm(seed=3, kind=kind, tie_word_embeddings=tie)
    mb = _batch(model.config.vocab_size)
    assert chunked_head(model) is not None
    naive = _naive(model, mb, 0.7)
    chunked = causal_lm_forward(
        model, mb, chunk_size=4, temperature=0.7, entropy="grad"
    )  # 30 tokens: 8 chunks
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(chunked[key], naive[key], atol=1e-5, rtol=0)
    assert float(naive["logprobs"].detach().abs().sum()) > 1.0  # not trivially zero
    g_naive, g_chunked = _loss_and_grads(model, naive), _loss_and_grads(model, chunked)
    assert g_naive.keys() == g_chunked.keys()
    assert ("lm_head.weight" in g_naive) is not tie  # a tied head's gradient lands on the embedding
    for name in g_naive:
        torch.testing.assert_close(g_chunked[name], g_naive[name], atol=1e-5, rtol=1e-5, msg=name)
    # the swap is undone: the model computes its logits again
    assert model(input_ids=mb["input_ids"]).logits.shape[-1] == model.config.vocab_size


def test_chunked_head_without_grad_and_logprobs_only():
    model = tiny_lm(seed=4)
    mb = _batch(model.config.vocab_size)
    with torch.no_grad():
        naive = token_outputs(
            model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long()).logits,
            mb,
            chunk_size=1024,
        )
        chunked = causal_lm_forward(model, mb, chunk_size=5)
    assert chunked.keys() == {"logprobs"}
    torch.testing.assert_close(chunked["logprobs"], naive["logprobs"], atol=1e-5, rtol=0)


def test_gemma2_softcapping_is_applied():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,
    )
    model = Gemma2ForCausalLM(cfg).float()
    assert chunked_head(model).transform == LogitTransform(softcap=0.5)
    mb = _batch(96)
    naive, chunked = _naive(model, mb, 1.0), causal_lm_forward(model, mb, chunk_size=7, entropy="grad")
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(chunked[key], naive[key], atol=1e-5, rtol=0)
    # the cap matters here: logits within +-0.5 give log-probs near -log(96)
    lp = naive["logprobs"][:, 1:][mb["attention_mask"][:, 1:]].detach()
    assert float((lp + torch.log(torch.tensor(96.0))).abs().max()) <= 1.0 + 1e-6


def test_unknown_model_type_falls_back_with_a_warning():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).eval()
    mb = _batch(64)
    with pytest.warns(UserWarning, match=r"model type 'gpt2' is not in CHUNKED_HEAD_MODEL_TYPES"):
        out = causal_lm_forward(model, mb, chunk_size=4, entropy="detached")
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long()).logits
    ref = token_outputs(logits, mb, chunk_size=4, entropy="detached")
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=0, rtol=0)


def test_sum_pi_squared_equals_the_full_logits_one():
    from yatt_algos.advantages import sum_pi_squared
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, LearnerConfig

    model = tiny_lm(seed=5)
    mb = _batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long()).logits
        expected = sum_pi_squared(logits[:, :-1] / 0.7)  # [b, t - 1]: the distribution predicting t + 1
        out = causal_lm_forward(model, mb, chunk_size=4, temperature=0.7, sum_pi_squared=True)
    mask = mb["attention_mask"]
    torch.testing.assert_close(
        out["sum_pi_squared"][:, 1:][mask[:, 1:]], expected[mask[:, 1:]], atol=1e-6, rtol=0
    )
    assert float(out["sum_pi_squared"][:, 0].abs().sum()) == 0.0  # position 0 has no predecessor
    learner = TorchPolicyLearner(
        model,
        algo=AlgoConfig(),
        optim_config=None,
        learner=LearnerConfig(temperature=0.7, logits_chunk_size=4),
    )
    lp, spi = learner.compute_logprobs_and_sum_pi_squared(
        {k: v for k, v in mb.items()} | {"response_mask": mask}
    )
    torch.testing.assert_close(lp, out["logprobs"], atol=1e-6, rtol=0)
    torch.testing.assert_close(spi, out["sum_pi_squared"], atol=1e-6, rtol=0)


def test_response_only_scoring_equals_the_full_head_on_the_response_and_skips_the_prompt():
    """`score_prompt=False` (the jobs' `learner.score_prompt_tokens=false`): the head runs only where the target
    is a response token; there the log-probs, entropy and every gradient of a response-masked loss are those of
    the full head (to float rounding: the chunks hold other rows), the prompt's positions are 0, and a micro-batch with no response token (a DP
    rank's filler) still scores its real tokens so its loss has a graph."""
    model = tiny_lm(seed=5)
    mb = _batch(model.config.vocab_size)
    response = mb["attention_mask"] & (torch.arange(11)[None] >= torch.tensor([[4], [6], [3]]))
    mb = {**mb, "response_mask": response}
    full = causal_lm_forward(model, mb, chunk_size=4, entropy="grad")
    only = causal_lm_forward(model, mb, chunk_size=4, entropy="grad", score_prompt=False)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(only[key] * response, full[key] * response, atol=1e-6, rtol=0, msg=key)
        assert float(only[key].detach()[~response].abs().sum()) == 0.0, key  # the prompt's are 0
        assert float(full[key].detach()[~response & mb["attention_mask"]].abs().sum()) > 0.1, key

    def masked(out):
        return {k: v * response for k, v in out.items()}

    g_full, g_only = _loss_and_grads(model, masked(full)), _loss_and_grads(model, masked(only))
    assert g_full.keys() == g_only.keys() and "lm_head.weight" in g_only
    for name in g_full:
        torch.testing.assert_close(g_only[name], g_full[name], atol=1e-6, rtol=1e-5, msg=name)
    filler = {**mb, "response_mask": torch.zeros_like(response)}
    out = causal_lm_forward(model, filler, chunk_size=4, score_prompt=False)
    assert out["logprobs"].requires_grad
    torch.testing.assert_close(out["logprobs"], full["logprobs"], atol=1e-6, rtol=0)
