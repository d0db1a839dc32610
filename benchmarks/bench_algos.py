"""Benchmark of yatt-algos' hot paths against their plain peers, side by side in one run.

1. logprobs + entropy from bf16 logits [B, T, V]: the chunked fp32 paths of `yatt_algos.value` (two calls,
   and the fused one) against the plain `log_softmax(logits.float())`, for time and for the peak resident memory the call adds (each variant
   runs in its own fresh process, which reports its ru_maxrss before and after).
2. GRPO advantages over B samples in groups given by ids: the vectorized estimator against a per-group
   Python loop (the dict-of-lists style of common trainers).
3. PPO-clip loss + token-mean aggregation, forward and backward, against the bare formula inline (no checks,
   no metrics): the price of validation and metrics.

`--quick` runs in under a minute on 2 cores; every variant uses one thread (steadier on a shared machine).
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CHILD = r"""
import resource, sys, time, torch
from yatt_algos.value import entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits
torch.set_num_threads(1)
b, t, v, variant = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# drawn straight into bf16, so no fp32 temporary raises the peak before the measurement starts
logits = torch.empty(b, t, v, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(0))
labels = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(1))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if variant == "chunked":
    lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
elif variant == "fused":
    lp, ent = logprobs_and_entropy_from_logits(logits, labels)
else:
    log_p = torch.log_softmax(logits.float(), dim=-1)
    lp = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
elapsed = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(elapsed, (after - before) / 1024, float(lp.sum()), float(ent.sum()))
"""


def _logits_case(b: int, t: int, v: int) -> dict:
    out = {"shape": [b, t, v]}
    sums = {}
    for variant in ("chunked", "fused", "naive"):
        res = subprocess.run(
            [sys.executable, "-c", _CHILD, str(b), str(t), str(v), variant],
            check=True,
            capture_output=True,
            text=True,
        )
        elapsed, peak_mb, lp_sum, ent_sum = map(float, res.stdout.split()[-4:])
        out[f"{variant}_s"] = round(elapsed, 4)
        out[f"{variant}_peak_mb"] = round(peak_mb, 1)
        sums[variant] = (lp_sum, ent_sum)
    # both paths must agree on the numbers they produce (fp32 sums over B*T positions)
    out["max_rel_diff"] = max(
        abs(a - b) / max(abs(b), 1.0) for a, b in zip(sums["chunked"], sums["naive"], strict=True)
    )
    return out


def _timeit(fn, repeats: int) -> float:
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _grpo_loop(scores, group_ids, eps):
    """The peer: per-group lists in a dict, then a Python pass per sample."""
    import torch

    by_group: dict[int, list[float]] = {}
    for s, g in zip(scores.tolist(), group_ids.tolist(), strict=True):
        by_group.setdefault(g, []).append(s)
    stats = {g: (torch.tensor(v).mean(), torch.tensor(v).std()) for g, v in by_group.items()}
    return torch.stack(
        [(s - stats[g][0]) / (stats[g][1] + eps) for s, g in zip(scores, group_ids.tolist(), strict=True)]
    )


def _grpo_case(num_samples: int, group_size: int, repeats: int) -> dict:
    import torch
    from yatt_algos.advantages import grpo
    from yatt_algos.types import AlgoConfig

    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (num_samples,), generator=gen).float()
    group_ids = torch.randperm(num_samples, generator=gen) // group_size  # groups scattered over the batch
    mask = torch.ones(num_samples, 1, dtype=torch.bool)
    cfg = AlgoConfig(adv_eps=1e-6)
    ours = grpo(scores, mask, cfg, group_ids=group_ids)[0][:, 0]
    peer = _grpo_loop(scores, group_ids, 1e-6)
    # the loop peer keeps singleton-free groups identical; any difference is float noise
    diff = float((ours - peer).abs().max())
    return {
        "num_samples": num_samples,
        "group_size": group_size,
        "yatt_s": round(_timeit(lambda: grpo(scores, mask, cfg, group_ids=group_ids), repeats), 5),
        "loop_s": round(_timeit(lambda: _grpo_loop(scores, group_ids, 1e-6), max(1, repeats // 10)), 5),
        "max_abs_diff": diff,
    }


def _ppo_case(b: int, t: int, repeats: int) -> dict:
    import torch
    from yatt_algos.aggregation import aggregate
    from yatt_algos.policy_losses import ppo_clip
    from yatt_algos.types import AlgoConfig

    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(b, t, generator=gen) * 3
    base = old + 0.05 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) > 0.2
    cfg = AlgoConfig()

    def ours():
        lp = base.clone().requires_grad_(True)
        loss, _ = ppo_clip(lp, old, adv, mask, cfg)
        aggregate(loss, mask, "token-mean").backward()

    def bare():
        lp = base.clone().requires_grad_(True)
        ratio = torch.exp(lp - old)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        ((loss * mask).sum() / mask.sum()).backward()

    return {
        "shape": [b, t],
        "yatt_s": round(_timeit(ours, repeats), 5),
        "bare_s": round(_timeit(bare, repeats), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, under a minute on 2 cores")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.quick:
        logits_shape, grpo_shape, ppo_shape, repeats = (2, 1024, 32000), (4096, 8), (32, 1024), 10
    else:
        logits_shape, grpo_shape, ppo_shape, repeats = (4, 2048, 32000), (16384, 16), (64, 4096), 20
    result = {
        "bench": "algos",
        "quick": args.quick,
        "logprobs_entropy": _logits_case(*logits_shape),
        "grpo_advantages": _grpo_case(*grpo_shape, repeats),
        "ppo_clip_fwd_bwd": _ppo_case(*ppo_shape, repeats),
    }
    for name, case in result.items():
        if isinstance(case, dict):
            print(f"{name}: {case}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
