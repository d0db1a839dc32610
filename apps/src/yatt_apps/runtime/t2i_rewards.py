"""The reward service of `yatt grpo-t2i` and the step's generation streamed into it.

`T2IRewardWorker` is the job's reward role, placed as the LLM jobs' (`job.policy_roles`): `reward`, which
shares the rollout engines' devices (no device of its own), when every term is light (the pixel rule, a small
image reward model), or `genrm` with its own devices when a `judge` model serves the VLM judge. It holds the
weighted sum of `cfg.rewards` over images (`yatt_multimodal.image_reward_specs`) and applies the terms'
failure policy, as `workers.RewardWorker` does for text.

`rollout_and_score` is the step's first phase: the controller's prompts in chunks over its rollout replicas,
each chunk's images handed to a reward replica the moment they are sampled (yatt_controller's streaming
stages), so scoring overlaps generation wherever the two roles have different devices. Images travel from a
controller's engines to the controller and on to its reward replicas only: never through the driver.
`reward_sums` / `reward_means` are the per-term and judge figures, in the LLM jobs' names.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from yatt_apps.runtime.workers import RewardWorker, build_engine, scored, set_threads

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext

__all__ = ["T2IRewardWorker", "agreement_sums", "reward_means", "reward_sums", "rollout_and_score"]

STATUSES = ("ok", "parse_error", "timeout", "error")


def _resources(cfg: Any, spec: Any, judge: dict[str, Any]) -> dict[str, Any]:
    """What the term `spec` is built from: the image reward model (`image_rm`: from a saved folder, or tiny
    over the policy pipeline's tokenizer), the judge's engine and codec (`genrm`), nothing for the rule."""
    if spec.kind == "image_rm":
        from transformers import AutoTokenizer
        from yatt_multimodal.image_reward_specs import image_rm_from_options

        tok = None
        if not spec.options.get("path"):
            tok = AutoTokenizer.from_pretrained(f"{cfg.t2i.path}/tokenizer", local_files_only=True)
        model = image_rm_from_options(spec.options, tok, image_size=cfg.t2i.image_size)
        return {"image_rm": model}
    return judge if spec.kind == "genrm" else {}


def _judge(cfg: Any, judge_dir: str, shared_device: bool) -> dict[str, Any]:
    """The VLM judge's HF engine (with the judge folder's image processor) and its Qwen2-VL codec."""
    from yatt_multimodal.vlm import QwenVLCodec

    from yatt_apps.io.models import is_vlm, load_image_processor, load_tokenizer

    spec = cfg.judge
    if not is_vlm(judge_dir):
        raise ValueError(
            f"judge {judge_dir} is not a vision-language model (no preprocessor_config.json): grpo-t2i's "
            "judge reads the images (judge.arch qwen2_vl, or a Qwen2-VL folder in judge.path)"
        )
    tok = load_tokenizer(judge_dir, trust_remote_code=spec.trust_remote_code)
    engine = build_engine(
        cfg,
        spec,
        "hf",
        judge_dir,
        seed=cfg.run.seed + 1,
        processor=load_image_processor(judge_dir),
        shared_device=shared_device,
    )
    return {"engine": engine, "codec": QwenVLCodec(tok), "seed": cfg.run.seed + 1}


class T2IRewardWorker(RewardWorker):
    """The weighted image rewards of `cfg.rewards` (module doc); the judge's engine lives in this process.
    Sleeps and wakes as the LLM jobs' `RewardWorker`."""

    def __init__(
        self, cfg: Any, judge_dir: str = "", *, shared_device: bool = True, worker_info: Any = None
    ) -> None:
        from yatt_multimodal.image_reward_specs import CombinedImageReward, build_image_reward

        set_threads(cfg)
        self.engine = None
        self.image_reward: CombinedImageReward | None = None
        if worker_info is not None and worker_info.tp_rank > 0:
            return  # a judge over k devices lives in its replica's first worker (as RewardWorker)
        judge = _judge(cfg, judge_dir, shared_device) if judge_dir else {}
        self.engine = judge.get("engine")
        terms = [(s.weight, build_image_reward(s, **_resources(cfg, s, judge))) for s in cfg.rewards]
        self.image_reward = CombinedImageReward(terms)

    def score(self, prompts: list[str], images: Any, tag: str) -> dict[str, Any]:  # type: ignore[override]
        """`RewardWorker.score`'s lists for each image, and `judgements` / `unparsed`: the judge's verdicts
        sampled and those that stated none (0 without a judge)."""
        from yatt_multimodal.types import RewardRequest

        if self.image_reward is None:  # a TP peer: dispatch returns the replica's first worker's answer
            return {}
        requests = [
            RewardRequest(request_id=f"{tag}-{i}", prompt=p, response="") for i, p in enumerate(prompts)
        ]
        batch = asyncio.run(self.image_reward.score(requests, images))
        return {
            **scored(batch, self.image_reward.failure_policy),
            "judgements": batch.metrics.num_judgements,
            "unparsed": batch.metrics.num_unparsed_judgements,
        }

    def close(self) -> None:
        if self.image_reward is not None:
            self.image_reward.close()


def _join(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-chunk engine outputs joined in prompt order (arrays along rows; the version of the first)."""
    import numpy as np

    return {
        key: parts[0][key] if key == "policy_version" else np.concatenate([p[key] for p in parts])
        for key in parts[0]
    }


def rollout_and_score(
    ctx: StepContext, prompts: list[str], seeds: list[int], tag: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One image per (prompt, seed) from this controller's rollout replicas, chunk by chunk, each chunk
    scored by a reward replica as soon as it is sampled. Returns (the engines' outputs joined: images,
    latents, log-probs, ... in prompt order; the scores: `T2IRewardWorker.score`'s lists joined, its counts
    summed, and `stream`: busy and overlap seconds). Every image must come from the current policy."""
    from yatt_controller.dispatch import split_evenly
    from yatt_controller.stream import Stage, run_stream

    from yatt_apps.runtime.phases import num_chunks

    rollout, reward = ctx.services["rollout"], ctx.services["reward"]
    chunks = [c for c in split_evenly(range(len(prompts)), num_chunks(len(prompts), rollout.dp_size)) if c]
    items = [
        (k, chunk, rollout.call_one("generate", [prompts[i] for i in chunk], [seeds[i] for i in chunk]))
        for k, chunk in enumerate(chunks)
    ]

    def score(item: Any, out: dict[str, Any]) -> Any:
        k, chunk, _ = item
        return reward.call_one("score", [prompts[i] for i in chunk], out["images"], f"{tag}-k{k}")

    result = run_stream(
        items,
        [Stage("rollout", lambda item, _: item[2]), Stage("reward", score)],
        max_inflight=len(items),
        fetch=ctx.get,
    )
    outs = [values[0] for values in result.values]
    ctx.check_versions([out["policy_version"] for out in outs])
    parts = [values[1] for values in result.values]
    scored: dict[str, Any] = {
        key: [v for p in parts for v in p[key]] for key in ("scores", "keep", "statuses", "sample_components")
    }
    scored |= {key: sum(p[key] for p in parts) for key in ("judgements", "unparsed")}
    scored["stream"] = {
        "rollout_s": result.busy_s("rollout"),
        "reward_s": result.busy_s("reward"),
        "overlap_s": result.overlap_s("rollout", "reward"),
    }
    return _join(outs), scored


def reward_sums(scored: dict[str, Any], kept: list[int], prefix: str = "") -> dict[str, float]:
    """This controller's sums (all-reduced by the step): each term's score over the kept images
    (`reward/<name>/sum`), the statuses of every image, and the judge's verdicts sampled and unparsed."""
    sums: dict[str, float] = {
        f"{prefix}reward_status/{s}": float(scored["statuses"].count(s)) for s in STATUSES
    }
    for i in kept:
        for name, value in scored["sample_components"][i].items():
            key = f"{prefix}reward/{name}/sum"
            sums[key] = sums.get(key, 0.0) + value
    if scored["judgements"]:
        sums[f"{prefix}judge/judgements"] = float(scored["judgements"])
        sums[f"{prefix}judge/unparsed"] = float(scored["unparsed"])
    return sums


def agreement_sums(specs: Any, components: list[dict[str, float]], prefix: str = "") -> dict[str, float]:
    """Over images where the judge's verdict (> 0: "matches") and the pixel rule (> 0.5: the named colour
    dominates the named half) both scored: how many, and how many agree (`judge/agreement`, as the LLM
    jobs' judge against math_verify). `specs`: the config's reward terms; {} without both."""
    judge = next((s.name or s.kind for s in specs if s.kind == "genrm"), "")
    rule = next((s.name or s.kind for s in specs if s.kind == "colour_position"), "")
    if not (judge and rule):
        return {}
    both = [c for c in components if judge in c and rule in c]
    agree = sum((c[judge] > 0) == (c[rule] > 0.5) for c in both)
    return {f"{prefix}judge/agree": float(agree), f"{prefix}judge/compared": float(len(both))}


def reward_means(total: dict[str, float], count: float, prefix: str = "") -> dict[str, float]:
    """From all-reduced sums over `count` kept images: `reward/<name>_mean` per term (the judge's mean vote
    in [-1, 1] under its name, its parsed fraction under `<name>/parsed_mean`), `reward_status/<s>` counts,
    `judge/parse_rate` (verdicts stated over verdicts sampled) and `judge/agreement`, the LLM jobs' names."""
    out: dict[str, float] = {}
    for key, value in total.items():
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        if name.startswith("reward/") and name.endswith("/sum"):
            out[f"{prefix}{name.removesuffix('/sum')}_mean"] = value / max(count, 1.0)
        elif name.startswith("reward_status/"):
            out[key] = value
    if total.get(f"{prefix}judge/judgements"):
        judged = total[f"{prefix}judge/judgements"]
        out[f"{prefix}judge/parse_rate"] = 1.0 - total[f"{prefix}judge/unparsed"] / judged
        out[f"{prefix}judge/judgements"] = judged
    if total.get(f"{prefix}judge/compared"):
        out[f"{prefix}judge/agreement"] = total[f"{prefix}judge/agree"] / total[f"{prefix}judge/compared"]
    return out
