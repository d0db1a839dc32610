"""A mixture-of-experts policy in the job's parts, without Ray: the tiny Qwen3-MoE a run builds
(`model.arch=qwen3_moe`), its HF engine's recorded experts turned into the learner batch's `routed_experts`
(`policy_inputs.routed_experts`), and the policy worker replaying them (R3): its old log-probs equal the
engine's to float tolerance and its update reports `moe/routing_agreement`. Config checks name their keys."""

from types import SimpleNamespace

import msgspec
import pytest
import torch
from yatt_apps.config import ModelSpec, RunConfig, hardware_problems
from yatt_apps.jobs.grpo import rollout_logprobs
from yatt_apps.runtime import policy_inputs
from yatt_apps.runtime.phases import pad_batch
from yatt_apps.runtime.workers import PolicyWorker

ONE_RANK = SimpleNamespace(dp_size=1, tp_size=1, dp_rank=0, tp_rank=0)


def _cfg(**changes) -> RunConfig:
    base = RunConfig()
    algo = msgspec.structs.replace(base.algo, **({"kl_loss_coef": 0.0} | changes))
    return msgspec.structs.replace(
        base,
        model=ModelSpec(arch="qwen3_moe"),
        algo=algo,
        optim=msgspec.structs.replace(base.optim, micro_batch_size=4),
    )


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from yatt_apps.io.data import arithmetic_task
    from yatt_apps.io.models import prepare_model, tokenizer_corpus

    corpus = tokenizer_corpus(arithmetic_task(64, seed=0))
    return str(prepare_model(ModelSpec(arch="qwen3_moe"), tmp_path_factory.mktemp("moe") / "policy", corpus))


def _rollout(model_dir):
    """4 prompts x 2 samples from the HF engine over the saved model: (prompts per sample, completions)."""
    from yatt_apps.io.models import load_causal_lm, load_tokenizer
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    tok = load_tokenizer(model_dir)
    prompts = [tok.encode(t) for t in ["12 + 7 =", "3 + 4 =", "25 + 25 = 50, 1 + 1 =", "9 ="]]
    engine = HFEngine(load_causal_lm(model_dir), tok, max_batch_size=8)
    try:
        out = engine.generate(
            [
                GenerateRequest(
                    request_id=str(i),
                    prompt=Prompt(token_ids=p),
                    sampling=SamplingParams(n=2, max_new_tokens=8, seed=i),
                )
                for i, p in enumerate(prompts)
            ]
        )
    finally:
        engine.close()
    return [prompts[int(c.request_id)] for c in out], out, tok


def test_r3_worker_logprobs_equal_the_engines_and_the_update_reports_agreement(moe_dir):
    torch.set_num_threads(1)
    prompts, samples, tok = _rollout(moe_dir)
    cfg = _cfg(routing_replay="r3", router_aux_coef=0.01)
    batch = pad_batch(prompts, [c.token_ids for c in samples], tok.pad_token_id)
    routes = policy_inputs.routed_experts(cfg, batch, samples)
    assert routes.shape == (*batch["input_ids"].shape, 2, 2) and routes.dtype == torch.int16
    batch["routed_experts"] = routes
    worker = PolicyWorker(cfg, moe_dir, "unused", worker_info=ONE_RANK)
    lp = worker.logprobs(batch)
    mask = batch["response_mask"]
    rollout = rollout_logprobs(batch, samples)
    torch.testing.assert_close(lp["old_logprobs"][mask], rollout[mask], rtol=0, atol=1e-5)
    advantages = torch.where(mask, torch.linspace(-1, 1, mask.shape[0])[:, None], 0.0)
    stats = worker.train({**batch, **lp, "advantages": advantages, "rollout_logprobs": rollout})
    assert stats["moe/routing_agreement"] == 1.0  # same fp32 weights: the learner's own top-k is the engine's
    assert stats["moe/router_aux"] >= 1.0


def test_routed_experts_only_from_samples_that_carry_them_and_not_for_r2():
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long)}
    dense = [SimpleNamespace(routed_experts=None), SimpleNamespace(routed_experts=None)]
    assert policy_inputs.routed_experts(_cfg(), batch, dense) is None
    from yatt_rollout.routing import encode_routes

    ids = torch.tensor([[[0, 1]], [[2, 3]], [[1, 3]]])  # 3 positions, 1 layer, top-2
    samples = [SimpleNamespace(routed_experts=encode_routes(ids)), SimpleNamespace(routed_experts=None)]
    out = policy_inputs.routed_experts(_cfg(), batch, samples)
    assert out[0, :3].tolist() == ids.tolist() and out[0, 3:].eq(-1).all() and out[1].eq(-1).all()
    assert policy_inputs.routed_experts(_cfg(routing_replay="r2"), batch, samples) is None


def test_moe_configs_that_cannot_run_name_their_keys():
    vllm = msgspec.structs.replace(RunConfig().rollout, engine="vllm")
    with pytest.raises(ValueError, match=r"algo.routing_replay='r3' .* use 'hf' or 'r2'"):
        msgspec.structs.replace(_cfg(routing_replay="r3"), rollout=vllm)
    assert not hardware_problems(msgspec.structs.replace(_cfg(routing_replay="r2"), rollout=vllm))
    with pytest.raises(ValueError, match=r"AlgoConfig\.routing_replay must be"):
        _cfg(routing_replay="r4")
