"""GPU smoke benchmark: the CUDA paths of YATT's learner and engine on one device, with only torch,
transformers, msgspec and megatron-core installed (no Ray, no vLLM, no network: what a lent device machine has).
The workspace packages are imported from this checkout's source folders.

1. Learner: `TorchPolicyLearner.update` (PPO-clip, token-mean, AdamW) on a Qwen2 model built from a config
   (hidden 1024, 8 layers, vocab 32000) in bf16 on CUDA: response tokens per second, median of timed steps.
2. HF engine: `HFEngine.generate`, 64 prompts x 128 sampled tokens, same model in bf16: generated tokens/s,
   the second time (`hf_engine_tokens_per_s_bf16`) and the first time its shapes are seen (`..._cold_...`).
3. Log-prob memory on CUDA: forward + backward of the summed log-probs and entropy of 4,096 tokens over a
   151,936-token vocabulary (hidden 1024, bf16), full logits (`naive`) against the learner's chunked head with
   its hand-written backward (`chunked`): peak allocated MiB above the inputs, milliseconds, largest log-prob
   difference.
4. Megatron parity: a tiny Qwen2 (fp32, TF32 off) converted to a Megatron-Core GPTModel at TP = 1 on NCCL
   (one process): max abs difference of its logits from the HF model's, and of one update's exported
   weights from the torch backend's. (TP > 1 needs several devices; the learner tests cover it on CPU.)

Prints one JSON line last. Without CUDA it prints {"skipped": "no CUDA device"} and exits 0.

    python benchmarks/gpu_smoke.py            # on a GPU machine
    python benchmarks/gpu_smoke.py --quick    # smaller model and fewer steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for src in sorted((ROOT / "packages").glob("*/src")):
    sys.path.insert(0, str(src))  # the workspace packages without installing them

import torch  # noqa: E402


def qwen2(hidden: int, layers: int, vocab: int, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 256, 1),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    return Qwen2ForCausalLM(config)


def batch(vocab: int, rows: int, prompt: int, response: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    ids = torch.randint(1, vocab, (rows, t), generator=g)
    attention = torch.ones(rows, t, dtype=torch.bool)
    mask = torch.zeros(rows, t, dtype=torch.bool)
    mask[:, prompt:] = True
    out = {
        "input_ids": ids,
        "attention_mask": attention,
        "response_mask": mask,
        "old_logprobs": torch.where(mask, -10.0, 0.0),
        "advantages": torch.where(mask, torch.randn(rows, 1, generator=g), 0.0),
    }
    return {k: v.to(device) for k, v in out.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def learner_tokens_per_s(
    hidden: int, layers: int, steps: int, device: str = "cuda", shape: tuple[int, int, int] = (32, 128, 384)
) -> float:
    """`shape`: rows, prompt and response tokens of the batch."""
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    model = qwen2(hidden, layers, 32000).to(device, torch.bfloat16)
    learner = TorchPolicyLearner(
        model,
        algo=AlgoConfig(loss_agg_mode="token-mean"),
        optim_config=OptimConfig(lr=1e-6, micro_batch_size=8),
    )
    data = batch(32000, *shape, device)
    tokens = int(data["response_mask"].sum())
    times = []
    for step in range(steps + 1):
        _sync(device)
        start = time.perf_counter()
        stats = learner.update(data)
        _sync(device)
        if step:  # the first step warms up kernels and the allocator
            times.append(time.perf_counter() - start)
    assert torch.isfinite(torch.tensor(stats.loss)), "non-finite loss in bf16"
    return tokens / statistics.median(times)


def engine_tokens_per_s(
    hidden: int, layers: int, new_tokens: int, device: str = "cuda"
) -> tuple[float, float]:
    """Generated tokens/s of 64 sampled prompts: the first time the engine meets their shapes, and again."""
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    model = qwen2(hidden, layers, 32000).to(torch.bfloat16)
    engine = HFEngine(model, max_batch_size=64, device=device, seed=0)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens)
    requests = [
        GenerateRequest(
            request_id=f"r{i}", prompt=Prompt(token_ids=list(range(1 + i, 33 + i))), sampling=sampling
        )
        for i in range(64)
    ]
    engine.generate(requests[:4])  # CUDA context, kernels loaded
    rates = []
    for _ in range(2):  # shapes (batch, KV length) seen for the first time, then again
        start = time.perf_counter()
        done = engine.generate(requests)
        rates.append(sum(len(c.token_ids) for c in done) / (time.perf_counter() - start))
    engine.close()
    return rates[0], rates[1]


def megatron_parity() -> dict[str, float]:
    """Max abs logit difference (Megatron TP=1 vs HF, fp32, TF32 off) and max abs difference of the weights
    after one identical update."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        hf = qwen2(128, 2, 512).cuda()
        optim = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=4, clip_grad_norm=1.0)
        megatron = MegatronPolicyLearner(hf.config, hf.state_dict(), algo=AlgoConfig(), optim_config=optim)
        data = batch(512, 8, 8, 24, "cpu", seed=1)
        ids = data["input_ids"].cuda()
        with torch.no_grad():
            t = ids.shape[1]
            pos = torch.arange(t, device="cuda").expand_as(ids)
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device="cuda"), 1)[None, None]
            logits = float((megatron.model(ids, pos, causal) - hf(input_ids=ids).logits).abs().max())
        torch_learner = TorchPolicyLearner(hf, algo=AlgoConfig(), optim_config=optim)
        megatron.update(data)
        torch_learner.update({k: v.cuda() for k, v in data.items()})
        exported = {k: v for bucket in megatron.export_weights(1 << 20) for k, v in bucket}
        trained = hf.state_dict()
        weights = max(float((exported[k].float() - trained[k].float()).abs().max()) for k in trained)
        return {
            "megatron_tp": 1,
            "megatron_logits_max_abs_diff": logits,
            "megatron_update_max_abs_diff": weights,
        }
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def logprob_memory_cuda(tokens: int = 4096, vocab: int = 151936, hidden: int = 1024) -> dict:
    """Peak CUDA memory and time of the log-probs' forward + backward: full logits vs the chunked head."""
    from yatt_algos.learner.lm_head import LogitTransform, head_token_outputs
    from yatt_algos.value import logprobs_and_entropy_from_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    hidden_states = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    out: dict = {}
    results = {}
    for variant in ("naive", "chunked", "naive", "chunked"):  # the second round is timed warm
        h = hidden_states.clone().requires_grad_(True)
        head.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        if variant == "naive":
            lp, ent = logprobs_and_entropy_from_logits(head(h)[None], labels[None], chunk_size=1024)
            lp, ent = lp[0], ent[0]
        else:
            both = head_token_outputs(
                h, head, labels, transform=LogitTransform(), chunk_size=1024, entropy=True
            )
            lp, ent = both[:, 0], both[:, 1]
        (lp.float().sum() + ent.float().sum()).backward()
        torch.cuda.synchronize()
        out[f"cuda_{variant}_logprob_ms"] = round((time.perf_counter() - started) * 1e3, 2)
        out[f"cuda_{variant}_logprob_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        results[variant] = lp.detach().float()
    out["cuda_logprob_max_abs_diff"] = float((results["naive"] - results["chunked"]).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    hidden, layers, steps = (512, 4, 3) if args.quick else (1024, 8, 5)
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "hidden": hidden,
        "layers": layers,
    }
    result["learner_tokens_per_s_bf16"] = round(learner_tokens_per_s(hidden, layers, steps), 1)
    cold, warm = engine_tokens_per_s(hidden, layers, 64 if args.quick else 128)
    result["hf_engine_tokens_per_s_bf16"] = round(warm, 1)
    result["hf_engine_cold_tokens_per_s_bf16"] = round(cold, 1)
    result |= logprob_memory_cuda()
    try:
        result |= megatron_parity()
    except ImportError as err:  # megatron-core not installed on this machine
        result["megatron_skipped"] = str(err)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
