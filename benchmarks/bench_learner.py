"""Benchmark of the yatt-algos learner: train-step throughput against a plain hand-written torch loop, and
data parallel DP = 2 over gloo against DP = 1, side by side in one run.

1. Overhead: the same tiny Qwen2 policy (built from a config) and batch, one PPO-clip step (token-mean,
   clip-grad 1.0, AdamW): `TorchPolicyLearner.update` against the bare loop (forward, log_softmax gather,
   clipped surrogate, backward, clip, step) with no checks, metrics, packing or normalizer bookkeeping.
   Reported: response tokens per second of each and their ratio (learner / plain; 1.0 = no overhead).
   Both use one thread.
2. Data parallel: the same global batch through DP = 1 (one process) and DP = 2 (two processes over gloo on
   127.0.0.1, each with half of the batch), one thread per rank: tokens per second and speed-up.

3. Memory of the logits: log-probs and entropy of 4,096 response tokens over a 151,936-token vocabulary
   (Qwen2's), forward and backward (gradients to the hidden states and the output projection), from the
   full [T, V] logits (the path before yatt-algos 0.4.0), through the chunked head the learner runs
   (`learner/lm_head.py` with `learner/chunked_logprobs.py`'s hand-written backward) and through the same
   chunks under activation checkpointing (0.4.0's head), each in a fresh process: `naive_logprob_mib`,
   `peak_logprob_mib` and `checkpoint_logprob_mib` are the peak RSS over the computation minus the RSS
   before it; the results are compared to the naive ones (max abs differences). `--quick` skips the
   checkpointed variant (its keys are null).

Timings are medians over steps after a warm-up step. `--quick` runs in about two minutes on 2 cores and needs
~8 GiB (the naive figure).
The last printed line is one JSON object.

    python benchmarks/bench_learner.py --quick
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


def _model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def _batch(num_seqs: int, max_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded sequences, lengths uniform in [max_len / 2, max_len], prompts of 16 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 2, max_len + 1, (num_seqs,), generator=g)
    pos = torch.arange(max_len)
    attention = pos[None] < lengths[:, None]
    response = attention & (pos[None] >= 16)
    return {
        "input_ids": torch.randint(1, vocab, (num_seqs, max_len), generator=g) * attention,
        "attention_mask": attention,
        "response_mask": response,
        "old_logprobs": torch.where(response, -float(torch.log(torch.tensor(vocab))), 0.0),
        "advantages": torch.where(response, torch.randn(num_seqs, 1, generator=g).expand(-1, max_len), 0.0),
    }


def _plain_step(model, opt, b) -> None:
    """The hand-written peer: one PPO-clip step on the whole batch."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"].long()).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
    mask = b["response_mask"][:, 1:].float()
    ratio = torch.exp(lp - b["old_logprobs"][:, 1:])
    adv = b["advantages"][:, 1:]
    loss = (torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _median_time(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _learner(model, micro: int, group=None):
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig

    optim = OptimConfig(lr=1e-5, micro_batch_size=micro, clip_grad_norm=1.0)
    return TorchPolicyLearner(
        model, algo=AlgoConfig(), optim_config=optim, learner=LearnerConfig(), group=group
    )


def _dp_worker(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    batch = _batch(args.seqs, args.len, args.vocab)
    per = args.seqs // 2
    shard = {k: v[args.rank * per : (args.rank + 1) * per] for k, v in batch.items()}
    learner = _learner(_model(args.hidden, args.layers, args.vocab), per, dist.group.WORLD)
    t = _median_time(lambda: learner.update(shard), args.steps)
    if args.rank == 0:
        print(json.dumps({"step_s": t}))
    dist.destroy_process_group()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _logprob_worker(path: str, tokens: int, vocab: int, hidden: int, chunk: int) -> None:
    """One of the logprob computations in this fresh process (the variant is the file's stem: naive,
    checkpoint or chunked); writes its peak and results to `path`."""
    import resource
    from pathlib import Path

    from yatt_algos.learner.lm_head import LogitTransform, head_token_outputs
    from yatt_algos.value import logprobs_and_entropy_from_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    variant = Path(path).stem
    before = _rss_mib()
    if variant == "naive":  # the old learner path: full logits, then the chunked log-softmax
        lp, ent = logprobs_and_entropy_from_logits(head(h)[None], labels[None], chunk_size=chunk)
        lp, ent = lp[0], ent[0]
    else:  # "chunked": what the learner runs (the hand-written backward); "checkpoint": each chunk checkpointed
        recompute = "checkpoint" if variant == "checkpoint" else "auto"
        both = head_token_outputs(
            h, head, labels, transform=LogitTransform(), chunk_size=chunk, entropy=True, recompute=recompute
        )
        lp, ent = both[:, 0], both[:, 1]
    (lp.sum() + ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out = {"lp": lp.detach(), "ent": ent.detach(), "gh": h.grad, "gw": head.weight.grad}
    torch.save(out | {"peak_mib": peak - before}, path)


def _logprob_memory(tokens: int, vocab: int, hidden: int, chunk: int, quick: bool) -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    results = {}
    # --quick skips the checkpointed variant (the head before 0.4.0, a reference figure only): each variant
    # is a fresh process that builds 150k-vocabulary logits, minutes on a loaded 2-core machine
    names = ("naive", "chunked") if quick else ("naive", "checkpoint", "chunked")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = str(Path(tmp) / f"{name}.pt")
            cmd = [sys.executable, __file__, "--logprob-worker", path, "--vocab", str(vocab)]
            cmd += ["--tokens", str(tokens), "--hidden", str(hidden), "--chunk", str(chunk)]
            subprocess.run(cmd, check=True)
            results[name] = torch.load(path)
    naive, chunked, ckpt = results["naive"], results["chunked"], results.get("checkpoint")

    def diff(key: str, other: dict[str, Any] = chunked) -> float:
        return float((naive[key] - other[key]).abs().max())

    return {
        "peak_logprob_mib": round(chunked["peak_mib"], 1),
        "naive_logprob_mib": round(naive["peak_mib"], 1),
        "checkpoint_logprob_mib": round(ckpt["peak_mib"], 1) if ckpt else None,
        "logprob_mem_ratio": round(chunked["peak_mib"] / naive["peak_mib"], 3),
        "logprob_max_abs_diff": diff("lp"),
        "entropy_max_abs_diff": diff("ent"),
        "grad_hidden_max_abs_diff": diff("gh"),
        "grad_head_max_abs_diff": diff("gw"),
        "checkpoint_max_abs_diff": max(diff(k, ckpt) for k in ("lp", "ent", "gh", "gw")) if ckpt else None,
        "logprob_shape": {"tokens": tokens, "vocab": vocab, "hidden": hidden, "chunk": chunk},
    }


def _dp2(args) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--seqs", str(args.seqs), "--len", str(args.len), "--hidden", str(args.hidden)]
    common += ["--layers", str(args.layers), "--vocab", str(args.vocab), "--steps", str(args.steps)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--dp-worker", str(rank), "--port", str(port), *common],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a DP worker failed")
    return json.loads(outs[0].strip().splitlines()[-1])["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dp-worker", type=int, default=None, dest="rank")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--len", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--logprob-worker", default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()
    if args.logprob_worker:
        torch.set_num_threads(2)
        _logprob_worker(args.logprob_worker, args.tokens, args.vocab, args.hidden, args.chunk)
        return
    if args.quick and args.rank is None:
        args.seqs, args.len, args.hidden, args.layers, args.vocab, args.steps = 16, 128, 128, 2, 1024, 3
    if args.rank is not None:
        _dp_worker(args)
        return

    from yatt_algos.types import LearnerConfig

    torch.set_num_threads(1)  # steadier on a shared machine; DP = 2 then uses one core per rank
    batch = _batch(args.seqs, args.len, args.vocab)
    tokens = int(batch["response_mask"].sum())
    plain_model = _model(args.hidden, args.layers, args.vocab)
    opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-5)
    plain_s = _median_time(lambda: _plain_step(plain_model, opt, batch), args.steps)
    learner = _learner(_model(args.hidden, args.layers, args.vocab), args.seqs)
    learner_s = _median_time(lambda: learner.update(batch), args.steps)
    dp2_s = _dp2(args)
    memory = _logprob_memory(4096, 151_936, 32, LearnerConfig().logits_chunk_size, args.quick)

    result = {
        "bench": "learner",
        "shape": {
            "seqs": args.seqs,
            "len": args.len,
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": args.vocab,
        },
        "response_tokens": tokens,
        "plain_loop_tokens_per_s": round(tokens / plain_s, 1),
        "learner_tokens_per_s": round(tokens / learner_s, 1),
        "learner_over_plain": round(plain_s / learner_s, 3),
        "dp1_tokens_per_s": round(tokens / learner_s, 1),
        "dp2_gloo_tokens_per_s": round(tokens / dp2_s, 1),
        "dp2_speedup": round(learner_s / dp2_s, 3),
        **memory,
    }
    print(
        f"plain loop {plain_s * 1e3:.1f} ms/step, learner {learner_s * 1e3:.1f} ms/step, DP=2 {dp2_s * 1e3:.1f} ms/step"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
