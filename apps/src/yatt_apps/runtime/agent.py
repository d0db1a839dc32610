"""Multi-turn rollouts in the jobs (`rollout.env=NAME`, `rollout.max_turns=K`): the rollout worker that runs
episodes of a registered environment on its engine, the `calculator` environment of the embedded arithmetic
task, and the helpers the GRPO step calls where a multi-turn trajectory differs from a completion.

The worker answers the same `generate(requests)` as `RolloutWorker`, with `yatt_rollout.types.Trajectory`s:
`token_ids` after the prompt are the model's turns and the environment's replies, `response_mask` is 1 on
model tokens only, `logprobs` are 0.0 on environment tokens. The job's prompt is the one the step rendered
(`data.system_prompt` + the row), so the token ids the learner trains on are exactly those the engine saw.
Rewards are the job's `rewards` on the decoded trajectory (rule terms and GenRM over the whole of it); the
environment's own reward is reported as `agent/env_reward_mean`.

Environments: `calculator` is registered here, `multiply` (needs its calculator) and `digit_sum` (the python
sandbox) in `yatt_rollout.tool_tasks`; `rollout.env="package.module:factory"` imports that module and
registers `factory` under that name (the only import a config can cause, named in it explicitly).

With `rollout.tools_in_prompt`, tools reach the prompt through the chat template's own tools support: the
step renders its prompts with
`prompt_tokenizer` (the policy tokenizer whose `apply_chat_template` gets the environment's `tools=`), so the
prompt the engine sees and the learner trains on lists exactly the tools the environment runs. Validation
also runs with the tools withheld (`val/accuracy_no_tools`: `WithoutTools`, requests tagged `NO_TOOLS`).
The multi-turn SFT warm start of a tiny policy on an environment's demonstrations is
`yatt_apps.runtime.agent_warmstart`.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from yatt_rollout import tool_tasks
from yatt_rollout.agent import agent_metrics, agent_sums
from yatt_rollout.env import ENVIRONMENTS, ToolEnvironment, register, with_tools
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


register("calculator", CalculatorEnv)
NO_TOOLS = "evalnotools"  # the request-id tag of validation episodes whose tools are withheld


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
        if cfg.rollout.tools_in_prompt or cfg.rollout.sft_steps:
            raise ValueError(
                "rollout.tools_in_prompt and rollout.sft_steps need an environment (rollout.env)"
            )
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
        factory = ENVIRONMENTS[resolve_env(cfg.rollout.env)]
        # each episode advances on its own (`AgentDriver`'s continuous mode): its next turn joins the engine's
        # running batch as soon as its tools return
        turns, context = cfg.rollout.max_turns, _context(self.engine)
        self.driver = AgentDriver(self.engine, tok, factory, max_turns=turns, max_total_tokens=context)
        self.without_tools = AgentDriver(
            self.engine,
            tok,
            lambda: tool_tasks.WithoutTools(factory()),
            max_turns=turns,
            max_total_tokens=context,
        )

    def generate(self, requests: list) -> list:
        """Episodes of every request, those tagged `NO_TOOLS` with the tools withheld (in request order)."""
        plain = [r for r in requests if not r.request_id.startswith(NO_TOOLS)]
        withheld = [r for r in requests if r.request_id.startswith(NO_TOOLS)]
        out = []
        for driver, reqs in ((self.driver, plain), (self.without_tools, withheld)):
            if reqs:
                out += driver.run(reqs, [{"prompt": req.prompt.text} for req in reqs])
        return out


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


class ToolPromptTokenizer:
    """The policy tokenizer with `tools` in every chat prompt it renders: `apply_chat_template` gets the
    environment's tools (`yatt_rollout.env.with_tools`, as `TurnCodec` renders them); everything else is the tokenizer's own. `base` is the plain tokenizer."""

    def __init__(self, base: Any, tools: list) -> None:
        self.base, self.tools = base, tools

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.base(*args, **kwargs)

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        messages, tool_kwargs = with_tools(self.base, conversation, self.tools)
        return self.base.apply_chat_template(messages, **tool_kwargs, **kwargs)


def prompt_tokenizer(tok: Any, cfg: RunConfig) -> Any:
    """`tok` rendering the tools of `cfg.rollout.env` into every prompt (`ToolPromptTokenizer`) with
    `rollout.tools_in_prompt`; else `tok` itself."""
    if not cfg.rollout.tools_in_prompt:
        return tok
    env = ENVIRONMENTS[resolve_env(cfg.rollout.env)]()
    return ToolPromptTokenizer(tok, list(env.tools))


def validation_without_tools(ctx: Any, val_rows: Any, cfg: RunConfig, tok: Any) -> dict[str, float]:
    """At the steps that validate: greedy episodes of this controller's validation rows with the tools
    withheld (no tools in the prompt, every call an error), scored by the environment. Sums to reduce."""
    from yatt_rollout.types import SamplingParams

    from yatt_apps.runtime.phases import generate, render_prompt
    from yatt_apps.runtime.step_metrics import evaluates

    if val_rows is None or not evaluates(ctx.step, cfg.run.num_steps, cfg.run.eval_every):
        return {}
    mine = val_rows()[ctx.rank :: ctx.world_size]
    if not mine:
        return {"val/no_tools_correct": 0.0, "val/no_tools_total": 0.0}
    plain = getattr(tok, "base", tok)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens)
    with ctx.phase("eval"):
        ids = [render_prompt(plain, row, cfg.data.system_prompt) for row in mine]
        outs = generate(ctx, mine, ids, greedy, NO_TOOLS, None)
    return {
        "val/no_tools_correct": float(sum(t.reward for t in outs)),
        "val/no_tools_total": float(len(mine)),
    }
