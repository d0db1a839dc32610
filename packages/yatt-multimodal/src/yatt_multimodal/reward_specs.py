"""From configs to rewards: `build_reward(spec, **resources)` for every registered kind, and `build_combined`
for a weighted list of specs (the app's `rewards:` section).

Rules take `rule_pool` (a `RuleWorkerPool` the caller holds; `build_combined` makes one for all its rule
terms when none is given, owned and closed by the combined reward); "genrm" needs `engine` (a yatt-rollout `Generator`) and `codec` (a `PromptCodec`), and
takes `media_check` for VLM judges and `seed` for reproducible judgements; "reward_model" needs `rm_model` and `rm_tokenizer` and reads the options
`batch_size`, `max_length`, `sigmoid`. A missing resource is a ValueError naming the spec and the resource.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from yatt_multimodal.rewards import CombinedReward, RewardFunction
from yatt_multimodal.rule_workers import RuleWorkerPool
from yatt_multimodal.rules import RULES, build_rule
from yatt_multimodal.types import JudgeSpec, RewardSpec


def need(spec: RewardSpec, resources: dict[str, Any], *names: str) -> list[Any]:
    """The `resources` a term of kind `spec.kind` is built from, in `names` order; a ValueError naming the
    missing ones (the image terms of `image_reward_specs` use it too)."""
    missing = [n for n in names if resources.get(n) is None]
    if missing:
        raise ValueError(
            f"RewardSpec kind {spec.kind!r} ({spec.name or spec.kind}) needs {', '.join(missing)}=..."
        )
    return [resources[n] for n in names]


def _genrm(spec: RewardSpec, resources: dict[str, Any]) -> RewardFunction:
    from yatt_multimodal.genrm import GenRMJudge

    engine, codec = need(spec, resources, "engine", "codec")
    judge = spec.judge or JudgeSpec()
    return GenRMJudge(
        engine,
        codec,
        judge,
        name=spec.name or "genrm",
        seed=resources.get("seed"),
        media_check=resources.get("media_check"),
    )


def _reward_model(spec: RewardSpec, resources: dict[str, Any]) -> RewardFunction:
    from yatt_multimodal.reward_model import SequenceClassifierReward

    model, tokenizer = need(spec, resources, "rm_model", "rm_tokenizer")
    unknown = sorted(set(spec.options) - {"batch_size", "max_length", "sigmoid"})
    if unknown:
        raise ValueError(f"RewardSpec.options for 'reward_model': unknown {unknown}")
    return SequenceClassifierReward(
        model,
        tokenizer,
        name=spec.name or "rm",
        batch_size=int(spec.options.get("batch_size", 16)),
        max_length=int(spec.options.get("max_length", 1024)),
        sigmoid=spec.options.get("sigmoid", "false") == "true",
    )


BUILDERS: dict[str, Callable[[RewardSpec, dict[str, Any]], RewardFunction]] = {
    **{kind: (lambda spec, resources: build_rule(spec, pool=resources.get("rule_pool"))) for kind in RULES},
    "genrm": _genrm,
    "reward_model": _reward_model,
}


def build_reward(spec: RewardSpec, **resources: Any) -> RewardFunction:
    if spec.kind not in BUILDERS:
        raise ValueError(f"RewardSpec.kind {spec.kind!r} is not registered; known: {sorted(BUILDERS)}")
    return BUILDERS[spec.kind](spec, resources)


def build_combined(specs: Sequence[RewardSpec], **resources: Any) -> CombinedReward:
    """`sum_i spec_i.weight * score_i`, each term under `spec.name or spec.kind` in `Reward.components`.
    Its rule terms share `resources["rule_pool"]`, or one pool of 4 workers it owns (`close()` closes it)."""
    owns: list[RuleWorkerPool] = []
    if resources.get("rule_pool") is None and any(spec.kind in RULES for spec in specs):
        owns.append(RuleWorkerPool(num_workers=4))
        resources = {**resources, "rule_pool": owns[0]}
    return CombinedReward([(spec.weight, build_reward(spec, **resources)) for spec in specs], owns=owns)
