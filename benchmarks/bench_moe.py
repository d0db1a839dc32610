"""Benchmark of rollout routing replay (R3, arXiv 2510.23027) on a tiny mixture-of-experts policy: the
training/rollout log-prob mismatch with R3 off and on, and how often the learner's own routing agrees with
the rollout's.

Setup: one tiny Qwen3-MoE built from a config (yatt_rollout.tiny, 8 experts, top-2, 4 layers). The rollout
engine (`HFEngine`) serves it in bfloat16 and samples n completions per prompt, recording each token's
experts; the learner (`TorchPolicyLearner`) holds the same weights in float32, as a trainer does. The mismatch
is `mismatch_metrics` (yatt_algos.learner.mismatch): the token mean of |learner - rollout| log-prob over the
response tokens, and its k3 KL. With R3 off the learner routes by its own float32 top-k, so near-tie choices
flip against the engine's bfloat16 ones and those tokens' log-probs jump; with R3 on it uses the engine's
recorded experts and only the precision difference is left. `moe.routing_agreement` is the share of
(token, layer) choices where the learner's own top-k equals the rollout's.

`--quick` takes well under a minute on 2 cores. The last printed line is one JSON object.

    python benchmarks/bench_moe.py --quick
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _engine_samples(model, num_prompts: int, n: int, max_new: int, vocab: int):
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 16, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
    engine = HFEngine(model, max_batch_size=64)
    try:
        requests = [
            GenerateRequest(
                request_id=f"p{i}",
                prompt=Prompt(token_ids=p),
                sampling=SamplingParams(n=n, max_new_tokens=max_new, seed=i),
            )
            for i, p in enumerate(prompts)
        ]
        completions = engine.generate(requests)
    finally:
        engine.close()
    return [prompts[int(c.request_id[1:])] for c in completions], completions


def _batch(prompts, completions):
    from yatt_algos.learner.routing import routes_to_batch
    from yatt_rollout.routing import decode_routes

    width = max(len(p) + len(c.token_ids) for p, c in zip(prompts, completions, strict=True))
    b = len(prompts)
    ids = torch.zeros((b, width), dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.bool)
    response = torch.zeros_like(attention)
    rollout_lp = torch.zeros((b, width))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        end = len(p) + len(c.token_ids)
        ids[i, :end] = torch.tensor(p + c.token_ids)
        attention[i, :end] = True
        response[i, len(p) : end] = True
        rollout_lp[i, len(p) : end] = torch.tensor(c.logprobs)
    first = completions[0].routed_experts
    routes = routes_to_batch(
        [decode_routes(c.routed_experts) for c in completions], width, first.num_layers, first.top_k
    )
    batch = {"input_ids": ids, "attention_mask": attention, "response_mask": response}
    return batch, rollout_lp, routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from yatt_algos.learner.mismatch import mismatch_metrics
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig
    from yatt_rollout.tiny import tiny_causal_lm

    vocab, started = 256, time.perf_counter()
    num_prompts, n, max_new = (8, 4, 24) if args.quick else (32, 8, 48)
    fp32 = tiny_causal_lm(vocab, arch="qwen3_moe", num_layers=4, seed=0, num_experts=8)
    bf16 = tiny_causal_lm(vocab, arch="qwen3_moe", num_layers=4, seed=0, num_experts=8).to(torch.bfloat16)
    prompts, completions = _engine_samples(bf16, num_prompts, n, max_new, vocab)
    batch, rollout_lp, routes = _batch(prompts, completions)
    mask = batch["response_mask"]
    out = {}
    for mode in ("off", "r3"):
        learner = TorchPolicyLearner(fp32, algo=AlgoConfig(routing_replay=mode), optim_config=None)
        own = learner.compute_old_logprobs({**batch, "routed_experts": routes})
        metrics = mismatch_metrics(own["old_logprobs"], rollout_lp, mask)
        key = "on" if mode == "r3" else "off"
        out[f"moe.mismatch_r3_{key}"] = round(metrics["mismatch_abs_mean"], 6)
        out[f"moe.mismatch_k3_r3_{key}"] = round(metrics["mismatch_k3"], 8)
        out[f"moe.mismatch_max_r3_{key}"] = round(metrics["mismatch_abs_max"], 4)
        if mode == "off":  # the learner's own routing, compared with the rollout's at every routed position
            valid = (routes >= 0).all(-1).all(-1) & batch["attention_mask"]
            same = (own["routed_experts"].long().sort(-1).values == routes.long().sort(-1).values).all(-1)
            out["moe.routing_agreement"] = round(float(same[valid].float().mean()), 4)
    out["moe.response_tokens"] = int(mask.sum())
    out["moe.seconds"] = round(time.perf_counter() - started, 1)
    for key, value in out.items():
        print(f"{key:28s} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
