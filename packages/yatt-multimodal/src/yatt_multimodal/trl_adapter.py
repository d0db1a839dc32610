"""A YATT reward as a TRL reward function: `TRLReward(reward)` is the callable `trl.GRPOTrainer(reward_funcs=...)`
takes (a batch of prompts and completions in, one score per completion out).

TRL calls it with `prompts`, `completions` (strings, or chat messages in conversational datasets),
`completion_ids` and every other dataset column as a keyword list; `reference_column` (default "answer")
names the column that becomes `RewardRequest.reference`. Each call builds one `RewardRequest` per completion,
scores the batch through the wrapped `RewardFunction` (rules, a GenRM judge on any yatt-rollout engine, a
`CombinedReward` of them) and applies the failure policy (`resolve_failures`), never a silent zero:

- "zero": the score of the terms that succeeded (0.0 for a lone reward), status kept in the log;
- "drop": `None`, TRL's "not scorable" (NaN in its reward table; a completion every reward function
  returns None for gets no advantage and stays out of its group's baseline);
- "fail": `RewardStepFailed` is raised and the training step stops.

Statuses are counted per call: logged as TRL metrics (`log_metric`, e.g. `yatt_reward/parse_error`), as a
per-completion `yatt_reward/status` column of TRL's completions table (`log_extra`), and through this module's
`logging` logger as a warning naming the first failures. `calls` keeps the latest calls' requests, rewards
and returned scores. TRL itself is not imported: the callable depends only on TRL's calling convention.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from yatt_multimodal.rewards import DEFAULT_POLICY, RewardBatch, RewardFunction, resolve_failures
from yatt_multimodal.types import OnFailure, RewardRequest, RewardSpec, RewardStatus

LOGGER = logging.getLogger(__name__)
_STATUSES: tuple[RewardStatus, ...] = ("ok", "parse_error", "timeout", "error")


@dataclass
class TRLRewardCall:
    """One call of a `TRLReward`: what was scored, the raw rewards, and what TRL was given."""

    step: int
    requests: list[RewardRequest]
    batch: RewardBatch
    scores: list[float | None]


def message_text(value: Any) -> str:
    """The text of a TRL prompt or completion: a string as is; a list of chat messages -> the last message's
    content (a string, or the text parts of a multimodal content list)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], Mapping):
        content = value[-1].get("content", "")
        if isinstance(content, str):
            return content
        return "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    raise ValueError(
        f"expected a string or a list of chat messages, got {type(value).__name__}: {value!r:.80}"
    )


def _run(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code, also where this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class TRLReward:
    """A `RewardFunction` behind TRL's reward-function signature. `name` is its column in TRL's logs
    (`rewards/<name>/mean`); `policy` overrides the failure policy (default: the reward's own
    `failure_policy`, else `DEFAULT_POLICY`); `keep_calls` bounds `calls`."""

    def __init__(
        self,
        reward: RewardFunction,
        *,
        name: str = "yatt_reward",
        reference_column: str | None = "answer",
        policy: Mapping[str, OnFailure] | None = None,
        keep_calls: int = 16,
    ) -> None:
        if not name:
            raise ValueError("TRLReward: name must be non-empty (it is the reward's column in TRL's logs)")
        self.reward, self.reference_column = reward, reference_column
        self.__name__ = name  # TRL names a callable reward by its __name__
        self.policy = dict(
            policy if policy is not None else getattr(reward, "failure_policy", DEFAULT_POLICY)
        )
        self.calls: deque[TRLRewardCall] = deque(maxlen=keep_calls)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        *,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        trainer_state: Any = None,
        **columns: Any,
    ) -> list[float | None]:
        step = int(getattr(trainer_state, "global_step", len(self.calls)))
        requests = self.requests(prompts, completions, completion_ids, columns, step)
        batch = _run(self.reward.score(requests))
        resolved = resolve_failures(batch, self.policy)  # raises RewardStepFailed where the policy is "fail"
        scores = [s if keep else None for s, keep in zip(resolved.scores, resolved.keep, strict=True)]
        self._log(batch, log_metric, log_extra)
        self.calls.append(TRLRewardCall(step, requests, batch, scores))
        return scores

    def requests(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None,
        columns: Mapping[str, Any],
        step: int,
    ) -> list[RewardRequest]:
        """One `RewardRequest` per completion, ids `<step>-<i>`."""
        if len(prompts) != len(completions):
            raise ValueError(f"TRLReward: {len(prompts)} prompts but {len(completions)} completions")
        references = [""] * len(completions)
        if self.reference_column is not None:
            if self.reference_column not in columns:
                raise ValueError(
                    f"TRLReward: the dataset has no column {self.reference_column!r} for the reference answer "
                    f"(columns: {sorted(columns)}); pass reference_column=None for rewards without one"
                )
            references = [str(r) for r in columns[self.reference_column]]
        ids = completion_ids if completion_ids is not None else [[] for _ in completions]
        return [
            RewardRequest(
                request_id=f"{step}-{i}",
                prompt=message_text(p),
                response=message_text(c),
                reference=ref,
                response_token_ids=list(tok),
            )
            for i, (p, c, ref, tok) in enumerate(zip(prompts, completions, references, ids, strict=True))
        ]

    def _log(self, batch: RewardBatch, log_metric: Callable | None, log_extra: Callable | None) -> None:
        statuses = [r.status for r in batch.rewards]
        counts = {status: statuses.count(status) for status in _STATUSES}
        if log_metric is not None:
            for status in _STATUSES[1:]:
                log_metric(f"{self.__name__}/{status}", float(counts[status]))
        if log_extra is not None:
            log_extra(f"{self.__name__}/status", statuses)
        failures = [r for r in batch.rewards if r.status != "ok"]
        if failures:
            detail = "; ".join(f"{r.request_id}: {r.status} ({r.error})" for r in failures[:3])
            LOGGER.warning(
                "%s: %d of %d completions not scored ok %s, policy %s: %s",
                self.__name__,
                len(failures),
                len(statuses),
                {k: v for k, v in counts.items() if k != "ok" and v},
                self.policy,
                detail,
            )


def trl_reward(
    specs: Sequence[RewardSpec],
    *,
    name: str = "yatt_reward",
    reference_column: str | None = "answer",
    **resources: Any,
) -> TRLReward:
    """`TRLReward` over `build_combined(specs, **resources)`: the app's `rewards:` section as one TRL reward
    (a "genrm" term needs `engine=` and `codec=`; see `yatt_multimodal.reward_specs`)."""
    from yatt_multimodal.reward_specs import build_combined

    return TRLReward(build_combined(specs, **resources), name=name, reference_column=reference_column)
