"""Multi-turn rollouts in the jobs (`rollout.env=NAME`, `rollout.max_turns=K`): the rollout worker that runs
episodes of a registered environment on its engine, the `calculator` environment of the embedded arithmetic
task, and the helpers the GRPO step calls where a multi-turn trajectory differs from a completion.

The worker answers the same `generate(requests)` as `RolloutWorker`, with `yatt_rollout.types.Trajectory`s:
`token_ids` after the prompt are the model's turns and the environment's replies, `response_mask` is 1 on
model tokens only, `logprobs` are 0.0 on environment tokens. The job's prompt is the one the step rendered
(`data.system_prompt` + the row), so the token ids the learner trains on are exactly those the engine saw.
Rewards are the job's `rewards` on the decoded trajectory (rule terms and GenRM over the whole of it); the
environment's own reward is reported as `agent/env_reward_mean`.

Environments: `calculator` is registered here; `rollout.env="package.module:factory"` imports that module
and registers `factory` under that name (the only import a config can cause, named in it explicitly).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from yatt_rollout.agent import agent_metrics, agent_sums
from yatt_rollout.env import ENVIRONMENTS, ToolEnvironment, register
from yatt_rollout.tools import calculator_tool, evaluate_arithmetic, format_number
from yatt_rollout.types import Action, Message, Observation, StepResult

from yatt_apps.config import RunConfig
from yatt_apps.runtime.workers import RolloutWorker

__all__ = [
    "AgentRolloutWorker",
    "CalculatorEnv",
    "agent_metrics",
    "agent_sums",
    "check_env",
    "mask_env_tokens",
]

AGENT_APPS = ("grpo",)  # the step functions that apply the response mask of multi-turn trajectories


class CalculatorEnv(ToolEnvironment):
    """The embedded arithmetic task ("a + b =", `yatt_apps.io.data.arithmetic_task`) with a calculator tool.

    A turn with tool calls gets the results; a turn without is an answer: right (its last integer equals the
    answer), the episode ends with reward 1.0; wrong, the user asks for another try (`FEEDBACK`) until
    `rollout.max_turns` runs out, the retry-with-feedback shape of verl's GSM8K interaction. Rows without
    an answer ("prompt" only, as the rollout worker sees them) are scored against the prompt's own value,
    which for this task is the answer."""

    FEEDBACK = "Not right; try again."

    def __init__(self) -> None:
        super().__init__([calculator_tool()])

    def score(self, text: str) -> float:
        answer = self.row.get("answer") or _expression_value(str(self.row.get("prompt", "")))
        numbers = re.findall(r"-?\d+", text)
        return float(bool(answer) and bool(numbers) and numbers[-1] == answer)

    def step(self, action: Action) -> StepResult:
        result = super().step(action)
        if result.done and result.reward == 0.0:  # a wrong answer: ask again
            feedback = Observation(messages=[Message(role="user", content=self.FEEDBACK)])
            return StepResult(observation=feedback, reward=0.0, done=False)
        return result


def _expression_value(prompt: str) -> str:
    try:
        return format_number(evaluate_arithmetic(prompt.strip().rstrip("=").strip()))
    except ValueError:
        return ""


# yatt_rollout's Environment protocol declares `tools` a settable Sequence, which ToolEnvironment's list
# attribute cannot match (invariance); a read-only property there would fix it (reported to yatt-rollout)
register("calculator", CalculatorEnv)  # type: ignore[arg-type]


def resolve_env(name: str) -> str:
    """The registry name of `rollout.env`: a registered name as is; "module:factory" imports the module
    and registers its `factory` under the full string. ValueError names the key."""
    if name in ENVIRONMENTS:
        return name
    if ":" in name:
        module, attr = name.split(":", 1)
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"rollout.env {name!r}: cannot load {attr!r} from {module!r}: {err}") from None
        register(name, factory)
        return name
    raise ValueError(
        f"rollout.env {name!r} is not a registered environment; registered: {sorted(ENVIRONMENTS)}"
    )


def check_env(cfg: RunConfig) -> None:
    """Config-time checks of a multi-turn job (before anything starts)."""
    if not cfg.rollout.env:
        return
    if cfg.app not in AGENT_APPS:
        raise ValueError(f"rollout.env is supported by the {list(AGENT_APPS)} app(s), not app={cfg.app!r}")
    resolve_env(cfg.rollout.env)


class AgentRolloutWorker(RolloutWorker):
    """`RolloutWorker` whose `generate` runs `cfg.rollout.env` episodes of up to `cfg.rollout.max_turns`
    model turns, each within the engine's context. Weight pushes reach the same engine."""

    def __init__(
        self, cfg: RunConfig, model_dir: str, *, shared_device: bool = True, worker_info: Any = None
    ) -> None:
        from yatt_rollout.agent import AgentDriver

        from yatt_apps.io.models import load_tokenizer

        super().__init__(cfg, model_dir, shared_device=shared_device, worker_info=worker_info)
        tok = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        self.driver = AgentDriver(
            self.engine,
            tok,
            resolve_env(cfg.rollout.env),
            max_turns=cfg.rollout.max_turns,
            max_total_tokens=_context(self.engine),
        )

    def generate(self, requests: list) -> list:
        return self.driver.run(requests, [{"prompt": req.prompt.text} for req in requests])


def _context(engine: Any) -> int:
    """The engine's context length: an episode (prompt included) must fit in it."""
    context = getattr(engine, "max_context", None) or getattr(engine, "max_model_len", None)
    if not context:
        raise ValueError(f"{type(engine).__name__} reports no context length (max_context / max_model_len)")
    return int(context)


def mask_env_tokens(batch: dict[str, Any], prompts: list[list[int]], trajectories: list) -> None:
    """Set `batch["response_mask"]` [B, T] (from `grpo.pad_batch`) to each trajectory's own mask: 0 on the
    environment's tokens, so they count in no loss, KL, entropy or advantage."""
    import torch

    mask = batch["response_mask"]
    for row, (prompt, traj) in enumerate(zip(prompts, trajectories, strict=True)):
        span = slice(len(prompt), len(prompt) + len(traj.token_ids))
        mask[row, span] = torch.tensor(traj.response_mask, dtype=torch.bool)
