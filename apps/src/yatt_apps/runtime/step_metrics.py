"""The metrics of an RL step, each a sum this controller adds to (all-reduced across controllers by the step)
and the means `summarize` makes of them: rewards and their terms, tokens, entropy, rollout/train mismatch, KL,
judge parse rate and agreement, and the greedy validation accuracy every `run.eval_every` steps and at the
run's last step.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from yatt_apps.config import RunConfig
from yatt_apps.runtime.phases import Scored, generate, prompt_index, render_prompt
from yatt_apps.runtime.policy_inputs import offpolicy_means

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext

VAL_TIMEOUT_S = 10.0  # per validation answer: math_verify of a short answer takes milliseconds


class ValidationSet:
    """A run's validation rows, called like the plain `() -> rows` function it wraps: built once in the
    controller's process for the whole run. What is pickled to a controller is the row function alone."""

    def __init__(self, rows: Callable[[], list]) -> None:
        self.rows = rows
        self._cached: list | None = None

    def __call__(self) -> list:
        if self._cached is None:
            self._cached = self.rows()
        return self._cached

    def __getstate__(self) -> dict[str, Any]:
        return {"rows": self.rows, "_cached": None}


@functools.cache
def _rule_pools() -> tuple[dict[int, Any], threading.Lock]:
    """The process's one holder of its rule pool (process id -> pool: a forked child makes its own) and the
    lock that guards it (a per-process cache, like a cached function's)."""
    return {}, threading.Lock()


MAX_RULE_WORKERS = 4


def rule_workers(cfg: RunConfig) -> int:
    """How many rule worker processes a host starts: its device's share of the node's cores (the cores this
    process may run on over `placement.cluster.devices_per_node`), at least 1 and at most MAX_RULE_WORKERS.
    More workers than cores only share them, and each then grades fewer answers a step on colder caches: on
    the tiny job's two cores and two devices, four workers a host spent 30 ms of CPU a step grading, one 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_RULE_WORKERS, max(1, cores // max(1, cfg.placement.cluster.devices_per_node)))


def rule_pool(num_workers: int | None = None) -> Any:
    """This process's killable rule workers (a started `RuleWorkerPool` of `num_workers`; `rule_workers(cfg)`
    for a job's), shared by everything that grades answers here: a controller's validation and the rule terms
    of the reward worker beside it. They live as long as the process, so a run's evaluations, and the runs of
    a host kept warm between jobs (`YATT_KEEP_HOSTS`), reuse them: each start is a fresh interpreter importing
    math_verify and sympy, about 1 s of CPU. Their supervisor ends with the process (kill -9 included); one
    that was closed is replaced. `num_workers` sizes a new pool (None: MAX_RULE_WORKERS); a live one keeps its
    size, since graders here may hold it (a later job on a warm host runs on the same cores)."""
    from yatt_multimodal.rule_workers import RuleWorkerPool

    pools, lock = _rule_pools()
    with lock:
        pool = pools.get(os.getpid())
        if pool is None or pool.closed:
            pools.clear()
            pool = pools[os.getpid()] = RuleWorkerPool(num_workers=num_workers or MAX_RULE_WORKERS)
            pool.start()  # returns at once: the supervisor imports while the policy generates
        return pool


def judge_sums(cfg: RunConfig, scored: Scored, kept: list[int]) -> dict[str, float]:
    """GenRM figures over the kept samples: verdicts parsed (of K judgements each) and agreement of the
    judge's verdict (score > 0) with the exact-answer rule (math_verify > 0.5) where both scored."""
    judge = next((s.name or s.kind for s in cfg.rewards if s.kind == "genrm"), None)
    if judge is None:
        return {}
    rule = next((s.name or s.kind for s in cfg.rewards if s.kind == "math_verify"), "")
    parsed = sum(scored.components[i].get(f"{judge}/parsed", 0.0) for i in range(len(scored.completions)))
    both = [c for c in (scored.components[i] for i in kept) if judge in c and rule in c]
    agree = sum((c[judge] > 0) == (c[rule] > 0.5) for c in both)
    return {
        "judge/parsed": parsed,
        "judge/judged": float(len(scored.completions)),
        "judge/agree": float(agree),
        "judge/compared": float(len(both)),
    }


def sample_sums(
    scored: Scored,
    kept: list[int],
    num_prompts: int,
    mask: Any,
    lp: dict[str, Any],
    rollout_lp: Any,
    scores: list[float] | None = None,
) -> dict[str, float]:
    """This controller's sums for `summarize` (all-reduced first): rewards of the trained samples (`scores`,
    default the scored ones), counts, tokens under `mask` [B, T], entropy, rollout/train mismatch, KL to the
    reference, per-term rewards, statuses of every scored completion, and the stream's busy times."""
    trained = [scored.scores[i] for i in kept] if scores is None else scores
    sums = {
        "reward/sum": sum(trained),
        "samples": float(len(kept)),
        "samples_dropped": float(len(scored.completions) - len(kept)),
        "prompts": float(num_prompts),
        "response_tokens": float(mask.sum()),
        "truncated": float(sum(c.finish_reason == "length" for c in scored.completions)),
        "mismatch/sum": float(((lp["old_logprobs"] - rollout_lp).abs() * mask).sum()),
        **{
            f"reward_status/{s}": float(scored.statuses.count(s))
            for s in ("ok", "parse_error", "timeout", "error")
        },
        **{f"stream/{k}": v for k, v in scored.stream.items()},
    }
    if "entropy" in lp:  # not where the forward gave the sum of squared probabilities instead (OTB)
        sums["entropy/sum"] = float((lp["entropy"] * mask).sum())
    for i in kept:
        for name, value in scored.components[i].items():
            sums[f"reward/{name}/sum"] = sums.get(f"reward/{name}/sum", 0.0) + value
    if "ref_logprobs" in lp:
        sums["kl/sum"] = float(((lp["old_logprobs"] - lp["ref_logprobs"]) * mask).sum())
    return sums


def evaluate(ctx: StepContext, val_rows: Any, cfg: RunConfig, tok: Any) -> dict[str, float]:
    """Greedy accuracy (math_verify against the answer) on this controller's share of the validation rows.
    The policy's answers are untrusted text: they are verified in this process's killable worker processes
    (`rule_pool()`) with a deadline each, as the reward service does, so an answer that sends math_verify into
    an endless computation counts as wrong (`val/timeout`) instead of hanging the controller."""
    from yatt_multimodal.rewards import RuleReward
    from yatt_multimodal.rules import math_reward
    from yatt_multimodal.types import RewardRequest
    from yatt_rollout.types import SamplingParams

    mine = val_rows()[ctx.rank :: ctx.world_size]
    if not mine:
        return {"val/correct": 0.0, "val/total": 0.0, "val/timeout": 0.0}
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens)
    ids = [render_prompt(tok, row, cfg.data.system_prompt) for row in mine]
    outs = sorted(generate(ctx, mine, ids, greedy, "eval", None), key=prompt_index)
    requests = [
        RewardRequest(
            request_id=f"eval-{i}",
            prompt=row.prompt,
            response=tok.decode(c.token_ids, skip_special_tokens=True),
            reference=row.answer,
        )
        for i, (row, c) in enumerate(zip(mine, outs, strict=True))
    ]
    pool = rule_pool(rule_workers(cfg))
    batch = RuleReward("val", math_reward, timeout_s=VAL_TIMEOUT_S, pool=pool).score_sync(requests)
    correct = sum(r.score for r in batch.rewards if r.status == "ok")
    timeouts = sum(r.status == "timeout" for r in batch.rewards)
    return {"val/correct": float(correct), "val/total": float(len(mine)), "val/timeout": float(timeouts)}


def evaluates(step: int, num_steps: int, every: int) -> bool:
    """Whether `step` (0-based, of a `num_steps` run) is evaluated: every `every` steps from step 0, and the
    run's last step whatever `every` is, so the final policy always has a validation figure; `every` 0
    disables validation entirely."""
    return bool(every) and (step % every == 0 or step == num_steps - 1)


def eval_steps(num_steps: int, every: int) -> list[int]:
    """The steps a `num_steps` run evaluates (`evaluates`), e.g. (30, 10) -> [0, 10, 20, 29]."""
    return [step for step in range(num_steps) if evaluates(step, num_steps, every)]


def maybe_evaluate(ctx: StepContext, val_rows: Any, cfg: RunConfig, tok: Any) -> dict[str, float]:
    """Validation sums at the steps `evaluates` names (every `run.eval_every` steps and the last; empty
    otherwise)."""
    if val_rows is None or not evaluates(ctx.step, cfg.run.num_steps, cfg.run.eval_every):
        return {}
    with ctx.phase("eval"):
        return evaluate(ctx, val_rows, cfg, tok)


def summarize(total: dict[str, float], stats: dict[str, float], world_size: int = 1) -> dict[str, float]:
    """Global means from summed counts; train stats are already global (reduced inside the learner);
    stream times are means over the `world_size` controllers."""
    samples, tokens = max(total["samples"], 1.0), max(total["response_tokens"], 1.0)
    out = {
        "reward/mean": total["reward/sum"] / samples,
        "rollout/response_len_mean": total["response_tokens"] / samples,
        "rollout/truncated_frac": total["truncated"] / max(total["samples"] + total["samples_dropped"], 1.0),
        "rollout/response_tokens": total["response_tokens"],
        "train/rollout_mismatch": total["mismatch/sum"] / tokens,
        "samples_dropped": total["samples_dropped"],
        # the learner's figures; bypass mode's loss gives the off-policy diagnostics (rollout_corr/) itself
        **{(k if k.startswith("rollout_corr/") else f"train/{k}"): v for k, v in stats.items()},
    }
    if "entropy/sum" in total:
        out["train/entropy"] = total["entropy/sum"] / tokens
    if "kl/sum" in total:
        out["train/kl"] = total["kl/sum"] / tokens
    out |= offpolicy_means(total)  # rollout_corr/*: verl's off-policy diagnostics, when a correction is on
    if total.get("val/total"):
        out["val/accuracy"] = total["val/correct"] / total["val/total"]
        out["val/timeout"] = total.get("val/timeout", 0.0)  # answers whose verification ran out of time
    if "async/samples" in total:  # bounded-staleness training (yatt_apps.runtime.producer)
        out["async/staleness_mean"] = total["async/staleness/sum"] / max(total["async/samples"], 1.0)
        out["async/staleness_max"] = total["async/staleness_max_all"] / max(world_size, 1)
        out["async/rollout_train_overlap_s"] = total["async/overlap_s"] / max(world_size, 1)
        out["async/partial_resumed"] = total.get("async/partial_resumed/sum", 0.0)  # rollout.partial
    if "judge/judged" in total:
        out["judge/parse_rate"] = total["judge/parsed"] / max(total["judge/judged"], 1.0)
        if total["judge/compared"]:
            out["judge/agreement"] = total["judge/agree"] / total["judge/compared"]
    if "agent/trajectories" in total:  # a multi-turn job (yatt_apps.runtime.agent)
        from yatt_rollout.agent import agent_metrics

        out.update(agent_metrics(total))
    for key, value in total.items():
        if key.startswith("reward/") and key.endswith("/sum") and key != "reward/sum":
            out[key.removesuffix("/sum") + "_mean"] = value / samples
        elif key.startswith("reward_status/"):
            out[key] = value
        elif key in ("stream/rollout_start", "stream/rollout_end", "stream/reward_end"):
            continue
        elif key.startswith("stream/"):
            name = {"overlap_s": "rollout_reward_overlap_s", "early": "judge_started_before_rollout_end"}
            out["time/" + name.get(key.removeprefix("stream/"), key.removeprefix("stream/"))] = value / max(
                world_size, 1
            )
    return out
