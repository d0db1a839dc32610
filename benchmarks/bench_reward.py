"""Benchmark of yatt-multimodal's rewards, peers side by side in one run.

1. GenRM judgements through yatt-rollout's HF engine (a tiny random Qwen2 judge; its verdicts are noise, the
   cost is real) on a batch where every response appears `dup` times: with dedup (each unique pair judged
   once) against without (every request judged). Reported: scored requests per second and sampled
   judgements per second. Without the HF engine installed, the scripted judge double stands in and the JSON
   says so (its figures then measure only the judge's own overhead).
2. Rule rewards: math verification through `RuleReward` (sync and async with per-request timeouts) on both
   backends, against the bare `math_verify.verify(parse(...))` call as the floor of what a rule can cost,
   and exact match.

`--quick` runs in under a minute on 2 cores. The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from yatt_multimodal.genrm import GenRMJudge
from yatt_multimodal.rules import build_rule
from yatt_multimodal.types import JudgeSpec, RewardRequest, RewardSpec


def _judge_engine():
    try:
        from yatt_multimodal.prompt_codecs import HFChatCodec
        from yatt_rollout.hf_engine import HFEngine
        from yatt_rollout.tiny import tiny_causal_lm, train_tokenizer
    except ImportError:
        from yatt_multimodal.prompt_codecs import ByteCodec
        from yatt_multimodal.testing import ScriptedJudgeEngine

        return "scripted", ScriptedJudgeEngine(lambda prompt, i: "Verdict: Yes"), ByteCodec()
    corpus = [f"{a} + {b} = {a + b}. Verdict: Yes. Verdict: No." for a in range(30) for b in range(30)]
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    return (
        "hf",
        HFEngine(tiny_causal_lm(len(tokenizer)), tokenizer, max_batch_size=256),
        HFChatCodec(tokenizer),
    )


def _requests(num_unique: int, dup: int) -> list[RewardRequest]:
    return [
        RewardRequest(
            request_id=f"r{u}-{d}",
            prompt=f"What is {u} + 3?",
            response=f"{u} + 3 = {u + 3}",
            reference=str(u + 3),
        )
        for d in range(dup)
        for u in range(num_unique)
    ]


def bench_genrm(num_unique: int, dup: int, num_samples: int, max_new_tokens: int, repeats: int) -> dict:
    kind, engine, codec = _judge_engine()
    requests = _requests(num_unique, dup)
    out: dict = {"engine": kind, "requests": len(requests), "unique": num_unique, "num_samples": num_samples}
    for dedup in (True, False):
        spec = JudgeSpec(
            num_samples=num_samples, max_new_tokens=max_new_tokens, dedup=dedup, max_concurrency=256
        )
        judge = GenRMJudge(engine, codec, spec, seed=0)
        asyncio.run(judge.score(requests[:2]))  # warm-up: first-call allocations
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            batch = asyncio.run(judge.score(requests))
            best = min(best, time.perf_counter() - start)
        key = "dedup" if dedup else "no_dedup"
        out[key] = {
            "seconds": round(best, 4),
            "requests_per_s": round(len(requests) / best, 1),
            "judgements_per_s": round(batch.metrics.num_judgements / best, 1),
            "judgements": batch.metrics.num_judgements,
        }
    out["dedup_speedup"] = round(out["no_dedup"]["seconds"] / out["dedup"]["seconds"], 2)
    if kind == "hf":
        engine.close()
    return out


def _rate(fn, n: int) -> float:
    start = time.perf_counter()
    fn()
    return round(n / (time.perf_counter() - start), 1)


def bench_rules(n: int) -> dict:
    forms = [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("so the answer is \\boxed{12}", "12"),
        ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ]
    requests = [
        RewardRequest(request_id=f"m{i}", prompt="q", response=forms[i % 3][0], reference=forms[i % 3][1])
        for i in range(n)
    ]
    out: dict = {"requests": n}
    for backend in ("math_verify", "sympy"):
        rule = build_rule(RewardSpec(kind="math_verify", options={"backend": backend}), max_concurrency=2)
        rule.score_sync(requests[:3])  # warm-up: imports and caches
        out[f"{backend}_sync_per_s"] = _rate(lambda rule=rule: rule.score_sync(requests), n)
        out[f"{backend}_async_per_s"] = _rate(lambda rule=rule: asyncio.run(rule.score(requests)), n)
    from math_verify import parse, verify

    def bare():
        for r in requests:
            verify(
                parse(f"${r.reference}$", parsing_timeout=None),
                parse(r.response, parsing_timeout=None),
                timeout_seconds=None,
            )

    out["bare_math_verify_per_s"] = _rate(bare, n)
    exact = build_rule(RewardSpec(kind="exact_match"))
    out["exact_match_sync_per_s"] = _rate(lambda: exact.score_sync(requests * 10), n * 10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute on 2 cores")
    args = parser.parse_args()
    if args.quick:
        genrm = bench_genrm(num_unique=8, dup=4, num_samples=2, max_new_tokens=8, repeats=1)
        rules = bench_rules(n=60)
    else:
        genrm = bench_genrm(num_unique=64, dup=4, num_samples=8, max_new_tokens=64, repeats=3)
        rules = bench_rules(n=1500)
    print("genrm:", json.dumps(genrm))
    print("rules:", json.dumps(rules))
    print(json.dumps({"bench": "reward", "quick": args.quick, "genrm": genrm, "rules": rules}))


if __name__ == "__main__":
    main()
