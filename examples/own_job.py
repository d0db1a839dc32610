"""A job of your own in one file: GRPO with your own reward function, run by the `yatt` command.

    yatt run examples/own_job.py --set run.num_steps=5

The file declares one `JOB = JobDef(...)` (yatt_apps.runtime.job): its name, its one-line help, its default
config (a preset function), and the parts it reuses from the shipped GRPO job: the step function (one flat
function: generate, score, advantages, train, sync) and the default services, with the reward service swapped
for `BrevityReward`, which adds a term of this file's own to the configured rule rewards. Everything else
(`--preset`, `--config`, `--set`, `--run-dir`, `yatt config --job examples/own_job.py`, `yatt plan --job ...`,
`yatt resume RUN_DIR --job examples/own_job.py`) works as for a shipped job.

The reward term: 1 / (1 + number of words after the first), so a response that stops after its answer scores
1, and one that rambles scores less. Each sample's score is the rule rewards' weighted sum (exact answer 1.0,
format 0.2) plus `BREVITY_WEIGHT` times the term, logged as `reward/brevity_mean`.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from yatt_apps.config import RunConfig, tiny_cpu
from yatt_apps.jobs.grpo import step_function
from yatt_apps.runtime.job import JobDef, build_services
from yatt_apps.runtime.workers import RewardWorker

BREVITY_WEIGHT = 0.5


def brevity(response: str) -> float:
    """Your reward function: 1 for a one-word response, 1/2 for two words, ..., 1 for an empty one."""
    return 1.0 / max(len(response.split()), 1)


class BrevityReward(RewardWorker):
    """The configured rewards (`rewards:` in the config) plus `BREVITY_WEIGHT` x `brevity(response)`. Hosted
    by the runtime on the reward role's devices, like the shipped reward service."""

    def score(self, requests: list) -> dict[str, Any]:
        out = super().score(requests)
        for i, request in enumerate(requests):
            term = brevity(request.response)
            out["scores"][i] += BREVITY_WEIGHT * term
            out["sample_components"][i]["brevity"] = term
        return out


def preset() -> RunConfig:
    """The tiny GRPO run without its judge: the warm-started tiny policy, exact-answer and format rules."""
    base = tiny_cpu()
    return msgspec.structs.replace(
        base,
        app="grpo-brevity",
        run=msgspec.structs.replace(base.run, name="grpo-brevity"),
        judge=None,
        rewards=[spec for spec in base.rewards if spec.kind != "genrm"],
    )


JOB = JobDef(
    name="grpo-brevity",
    help="GRPO on the tiny task with an extra reward of your own: shorter responses score higher",
    preset=preset,
    step=step_function,
    build=functools.partial(build_services, reward_cls=BrevityReward),
)
