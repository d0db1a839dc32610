"""GRPO with rule rewards and a generative reward model: the flagship job.

`grpo_step` is the whole RL step, run by every controller on its own shard of prompts (parallel mode) or by
one driver-side controller on all of them (single mode): generate n completions per prompt, score them (rule
terms and K GenRM judgements per completion), old and reference logprobs, group-normalised advantages, the
SPMD update across controllers, and the versioned weight push. It reads top to bottom.
"""

from __future__ import annotations

import functools
from typing import Any

from yatt_apps.config import RunConfig
from yatt_apps.data import PromptRow

_TOKENIZERS: dict[str, Any] = {}  # per controller process: model dir -> tokenizer


def tokenizer(path: str):
    if path not in _TOKENIZERS:
        from yatt_apps.models import load_tokenizer

        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


def render_prompt(tok, row: PromptRow, system_prompt: str) -> list[int]:
    """The chat-templated prompt token ids of one row; a row with images opens its user turn with one
    Qwen2-VL placeholder per image (one pad token each: the engine expands it to the image's size)."""
    placeholders = "<|vision_start|><|image_pad|><|vision_end|>" * len(row.images)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": placeholders + row.prompt}
    ]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_requests(
    rows: list[PromptRow], prompt_ids: list[list[int]], sampling, tag: str, seed: int | None
) -> list:
    """One request per prompt. With `seed`, request i samples from seed + i: a resumed run draws the same
    completions as one that never stopped, whatever the engine did before."""
    import msgspec
    from yatt_rollout.types import GenerateRequest, MediaRef, Prompt

    return [
        GenerateRequest(
            request_id=f"{tag}-p{i}",
            prompt=Prompt(
                token_ids=ids, text=row.prompt, media=[MediaRef(kind="image", uri=p) for p in row.images]
            ),
            sampling=sampling if seed is None else msgspec.structs.replace(sampling, seed=seed + i),
        )
        for i, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))
    ]


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, Any]:
    """Right-padded [B, T] input_ids, attention_mask and response_mask (True on response tokens)."""
    import torch

    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.bool)
    response = torch.zeros_like(attention)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = True
        response[i, len(p) : len(p) + len(r)] = True
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response}


def flat(parts: list[list[Any]]) -> list[Any]:
    return [item for part in parts for item in part]


def grpo_step(
    ctx, rows: list[PromptRow], *, cfg: RunConfig, policy_dir: str, val_rows=None
) -> dict[str, float]:
    """One GRPO step on this controller's `rows`; returns metrics already reduced over controllers."""
    import torch
    from yatt_algos.advantages import ADVANTAGE_ESTIMATORS

    tok = tokenizer(policy_dir)

    with ctx.phase("rollout"):  # n completions per prompt, on this controller's rollout replicas
        prompt_ids = [render_prompt(tok, row, cfg.data.system_prompt) for row in rows]
        tag = f"s{ctx.step}-c{ctx.rank}"
        completions, owner = generate(ctx, rows, prompt_ids, cfg.sampling, tag, sample_seed(cfg, ctx))

    with ctx.phase("reward"):  # rule terms + K GenRM judgements per completion, failure policy applied
        scored = score(ctx, rows, completions, owner, tok)
        scores, keep = scored["scores"], scored["keep"]

    with ctx.phase("advantages"):  # a prompt's group never leaves this controller
        kept = [i for i, k in enumerate(keep) if k]
        batch = pad_batch([prompt_ids[owner[i]] for i in kept], [completions[i].token_ids for i in kept],
                          tok.pad_token_id)  # fmt: skip
        if cfg.rollout.env:  # multi-turn: the environment's tokens are not the policy's (mask 0)
            from yatt_apps.agent import mask_env_tokens

            mask_env_tokens(batch, [prompt_ids[owner[i]] for i in kept], [completions[i] for i in kept])
        group_ids = torch.tensor([owner[i] for i in kept])
        score_t = torch.tensor([scores[i] for i in kept], dtype=torch.float32)
        advantages, _ = ADVANTAGE_ESTIMATORS[cfg.algo.adv_estimator](
            score_t, batch["response_mask"], cfg.algo, group_ids=group_ids
        )

    with ctx.phase("logprobs"):  # old (this policy) and reference logprobs, on this controller's learner rank
        lp, rollout_lp = old_logprobs(ctx, batch, [completions[i] for i in kept])

    with ctx.phase("train"):  # SPMD: every controller's learner rank updates together (gradient all-reduce)
        logprobs = {k: v for k, v in lp.items() if k != "entropy"}
        experience = {**batch, **logprobs, "advantages": advantages, "rollout_logprobs": rollout_lp,
                      "group_ids": group_ids}  # fmt: skip
        stats = ctx.get(ctx.learner.rank_zero("train", experience))

    with ctx.phase("weight_sync"):  # rank 0 pushes version v+1 to every rollout engine; all wait
        ctx.sync_weights()

    sums = sample_sums(
        [scores[i] for i in kept], len(keep) - len(kept), len(rows), completions, batch["response_mask"],
        lp, rollout_lp, scored,
    )  # fmt: skip
    if cfg.rollout.env:  # turns, tool calls, tool errors by kind, truncated episodes
        from yatt_apps.agent import agent_sums

        sums.update(agent_sums(completions))
    if val_rows is not None and cfg.run.eval_every and ctx.step % cfg.run.eval_every == 0:
        with ctx.phase("eval"):
            sums.update(evaluate(ctx, val_rows, cfg, tok))
    total = ctx.all_reduce(sums)
    return summarize(total, stats)


def sample_seed(cfg: RunConfig, ctx, wave: int = 0) -> int:
    """The base sampling seed of this controller's step; prompt i of a wave samples from base + i (< 1000
    prompts per wave). Refill waves (wave > 0, DAPO) draw from disjoint seeds: wave << 40."""
    return (cfg.run.seed * 1_000_003 + ctx.step * 10_007 + ctx.rank * 1_009) * 1_000 + (wave << 40)


def generate(ctx, rows: list[PromptRow], prompt_ids: list[list[int]], sampling, tag: str, seed: int | None):
    """n completions per prompt on this controller's rollout replicas, all made by the current policy
    version, and the prompt index (the GRPO group) of each completion."""
    requests = make_requests(rows, prompt_ids, sampling, tag, seed)
    completions = flat(ctx.get(ctx.services["rollout"].scatter("generate", requests)))
    ctx.check_versions([c.policy_version for c in completions])  # never train on another policy's samples
    errors = [c.error for c in completions if c.finish_reason == "error"]
    if errors:
        raise ValueError(f"rollout failed for {len(errors)} completion(s): {errors[0]}")
    return completions, [int(c.request_id.rsplit("-p", 1)[1]) for c in completions]


def score(ctx, rows: list[PromptRow], completions: list, owner: list[int], tok) -> dict[str, Any]:
    """Every completion scored on this controller's reward replicas, failure policy applied: `scores` [N],
    `keep` [N] (False: a failed score the policy drops), `statuses` [N], `components` summed over N."""
    from yatt_multimodal.types import RewardRequest

    texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    reward_requests = [
        RewardRequest(
            request_id=c.request_id + f"-r{c.index}",
            prompt=rows[g].prompt,
            response=text,
            reference=rows[g].answer,
        )
        for c, g, text in zip(completions, owner, texts, strict=True)
    ]
    parts = ctx.get(ctx.services["reward"].scatter("score", reward_requests))
    components: dict[str, float] = {}
    for part in parts:
        for name, value in part["components"].items():
            components[name] = components.get(name, 0.0) + value
    return {"scores": flat([p["scores"] for p in parts]), "keep": flat([p["keep"] for p in parts]),
            "statuses": flat([p["statuses"] for p in parts]), "components": components}  # fmt: skip


def old_logprobs(ctx, batch: dict[str, Any], responses: list) -> tuple[dict[str, Any], Any]:
    """Old (this policy) and reference logprobs and entropy [B, T] from this controller's learner rank, and
    the rollout engine's own logprobs of `responses` (one per row of `batch`) on the same tokens [B, T]."""
    import torch

    lp = ctx.get(ctx.learner.rank_zero("logprobs", batch))
    rollout_lp = torch.zeros_like(lp["old_logprobs"])
    for row, completion in enumerate(responses):
        logprobs = completion.logprobs
        if hasattr(completion, "response_mask"):  # a multi-turn trajectory: the model's tokens only
            logprobs = [v for v, m in zip(logprobs, completion.response_mask, strict=True) if m]
        rollout_lp[row, batch["response_mask"][row]] = torch.tensor(logprobs)
    return lp, rollout_lp


def sample_sums(kept_scores: list[float], num_dropped: int, num_prompts: int, completions: list, mask,
                lp: dict[str, Any], rollout_lp, scored: dict[str, Any]) -> dict[str, float]:  # fmt: skip
    """This controller's sums for `summarize` (all-reduced first): rewards of the trained samples, counts,
    tokens under `mask` [B, T], entropy, rollout/train mismatch, KL to the reference, reward components and
    statuses of every scored completion."""
    sums = {
        "reward/sum": sum(kept_scores), "samples": float(len(kept_scores)), "samples_dropped": float(num_dropped),
        "prompts": float(num_prompts), "response_tokens": float(mask.sum()),
        "truncated": float(sum(c.finish_reason == "length" for c in completions)),
        "entropy/sum": float((lp["entropy"] * mask).sum()),
        "mismatch/sum": float(((lp["old_logprobs"] - rollout_lp).abs() * mask).sum()),
        **{f"reward/{k}/sum": v for k, v in scored["components"].items()},
        **{f"reward_status/{s}": float(scored["statuses"].count(s)) for s in ("ok", "parse_error", "timeout", "error")},
    }  # fmt: skip
    if "ref_logprobs" in lp:
        sums["kl/sum"] = float(((lp["old_logprobs"] - lp["ref_logprobs"]) * mask).sum())
    return sums


def evaluate(ctx, val_rows, cfg: RunConfig, tok) -> dict[str, float]:
    """Greedy accuracy (math_verify against the answer) on this controller's share of the validation rows."""
    from yatt_multimodal.rules import math_reward
    from yatt_multimodal.types import RewardRequest
    from yatt_rollout.types import SamplingParams

    mine = val_rows()[ctx.rank :: ctx.world_size]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens)
    ids = [render_prompt(tok, row, cfg.data.system_prompt) for row in mine]
    rollout = ctx.services["rollout"]
    outs = flat(ctx.get(rollout.scatter("generate", make_requests(mine, ids, greedy, "eval", None))))
    correct = sum(
        math_reward(
            RewardRequest(
                request_id="eval",
                prompt=row.prompt,
                response=tok.decode(c.token_ids, skip_special_tokens=True),
                reference=row.answer,
            )
        )
        for row, c in zip(mine, sorted(outs, key=lambda c: int(c.request_id.rsplit("-p", 1)[1])), strict=True)
    )
    return {"val/correct": float(correct), "val/total": float(len(mine))}


def summarize(total: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """Global means from summed counts; train stats are already global (reduced inside the learner)."""
    samples, tokens = max(total["samples"], 1.0), max(total["response_tokens"], 1.0)
    out = {
        "reward/mean": total["reward/sum"] / samples,
        "rollout/response_len_mean": total["response_tokens"] / samples,
        "rollout/truncated_frac": total["truncated"] / max(total["samples"] + total["samples_dropped"], 1.0),
        "rollout/response_tokens": total["response_tokens"],
        "train/entropy": total["entropy/sum"] / tokens,
        "train/rollout_mismatch": total["mismatch/sum"] / tokens,
        "samples_dropped": total["samples_dropped"],
        **{f"train/{k}": v for k, v in stats.items()},
    }
    if "kl/sum" in total:
        out["train/kl"] = total["kl/sum"] / tokens
    if total.get("val/total"):
        out["val/accuracy"] = total["val/correct"] / total["val/total"]
    if "agent/trajectories" in total:  # a multi-turn job (yatt_apps.agent)
        from yatt_rollout.agent import agent_metrics

        out.update(agent_metrics(total))
    for key, value in total.items():
        if key.startswith("reward/") and key.endswith("/sum") and key != "reward/sum":
            out[key.removesuffix("/sum") + "_mean"] = value / samples
        elif key.startswith("reward_status/"):
            out[key] = value
    return out


def step_function(cfg: RunConfig, policy_dir: str, val_rows=None):
    return functools.partial(grpo_step, cfg=cfg, policy_dir=policy_dir, val_rows=val_rows)
