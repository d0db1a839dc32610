"""GPU smoke benchmark: the CUDA paths of YATT's learner and engine on one device, with only torch,
transformers, msgspec and megatron-core installed (no Ray, no vLLM, no network: what a lent device machine has).
The workspace packages are imported from this checkout's source folders.

1. Learner: `TorchPolicyLearner.update` (PPO-clip, token-mean, AdamW) on a Qwen2 model built from a config
   (hidden 1024, 8 layers, vocab 32000) in bf16 on CUDA: response tokens per second, median of timed steps.
2. HF engine: `HFEngine.generate`, 64 prompts x 128 sampled tokens, same model in bf16: generated tokens/s.
3. Megatron parity: a tiny Qwen2 (fp32, TF32 off) converted to a Megatron-Core GPTModel at TP = 1 on NCCL
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


def engine_tokens_per_s(hidden: int, layers: int, new_tokens: int, device: str = "cuda") -> float:
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
    engine.generate(requests[:4])  # warm-up
    start = time.perf_counter()
    done = engine.generate(requests)
    seconds = time.perf_counter() - start
    engine.close()
    return sum(len(c.token_ids) for c in done) / seconds


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
    result["hf_engine_tokens_per_s_bf16"] = round(
        engine_tokens_per_s(hidden, layers, 64 if args.quick else 128), 1
    )
    try:
        result |= megatron_parity()
    except ImportError as err:  # megatron-core not installed on this machine
        result["megatron_skipped"] = str(err)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
