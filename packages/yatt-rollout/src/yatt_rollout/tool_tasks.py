"""Tasks that need their tool, as environments with their own data and demonstrations.

- `MultiplyEnv` ("multiply"): "347 * 86 =", a 3-digit by 2-digit product. A tiny model cannot multiply, so
  without the calculator it guesses; with it, it copies the expression into a call and the result into its
  answer. The final answer (a turn without tool calls) ends the episode: reward 1.0 when its last integer
  is the product.
- `DigitSumEnv` ("digit_sum"): "digit sum of 7 ** 23 =", answered by running a short program in the python
  sandbox (`python_tool`).

Each declares its tools once (`tools`, the `ToolSpec`s that the prompt renders and `ToolEnvironment` runs),
draws its own rows (`rows(n, seed)`: dicts with "prompt" and "answer") and writes demonstrations for a
multi-turn SFT warm start (`demonstrations(rows, seed)`: TRL's chat format, `{"messages": [...], "tools":
[...]}` with `tool_calls` and `tool` messages). A demonstration's tool messages are the environment's own
replies to its calls, so the warm start, the prompt and the rollout agree token for token. The mix
(`demo_mix(row)`): some rows solved with the tool, some answered without it (a guess, as a model without
the tool writes one), some with a wrong first call (an unknown tool name or a broken argument) that the
tool's error message corrects. `MultiplyEnv`'s demonstrator is an imperfect teacher: it mostly calls for
multipliers of 50 and more and mostly guesses below, so the warm-started policy knows the format and
copies results but calls only for part of the prompts; RL teaches it to call for the others.

`WithoutTools(env)` withholds an environment's tools: the prompt lists none and every call is answered with
an error (counted as `unknown_tool`); the final answer is scored as usual (validation "with tools withheld").
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from yatt_rollout.env import ToolEnvironment, parse_tool_calls, register, tool_schemas
from yatt_rollout.tools import calculator_tool, evaluate_arithmetic, format_number, python_tool
from yatt_rollout.types import Action, Message, Observation, StepResult, ToolSpec

# the demonstration mix: (with the tool, answered directly, a wrong first call then corrected). DEMO_MIX is
# the default (`FinalAnswerEnv.demo_mix`); MultiplyEnv draws from HARD_MIX for multipliers >= 50 and EASY_MIX
# below (57 % of its demonstrations call). Measured (tiny_cpu_agent, hidden 128, 800 SFT steps, seed 0):
# the greedy policy calls on every b >= 50 prompt and on none below, copies the result right 82 % of the
# time (val/accuracy 0.44), and samples a call on ~15 % of the b < 50 prompts, which GRPO turns into calls.
# With one mix for every row, greedy decoding called on all prompts or on none; with right direct answers
# the policy learned to estimate the product instead of copying the tool's result (2 % copied at 800 steps).
DEMO_MIX = (0.3, 0.6, 0.1)
HARD_MIX = (0.6, 0.15, 0.25)
EASY_MIX = (0.1, 0.85, 0.05)


def last_integer(text: str) -> str:
    """The last integer written in `text` ("" if none): the final answer of these tasks."""
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else ""


class FinalAnswerEnv(ToolEnvironment):
    """A `ToolEnvironment` whose first turn without calls is the answer: reward 1.0 when its last integer
    is the row's answer (or, for a row with only a prompt, `answer_of(prompt)`), and the episode ends.
    Demonstrations answer directly as `ANSWER` says with a `guess` (one opening: the choice to call is the
    first token of the turn) and after a tool result with the number alone (the copy a small model learns
    first)."""

    ANSWER = "The answer is {}."

    def answer_of(self, prompt: str) -> str:
        raise NotImplementedError

    def score(self, text: str) -> float:
        answer = str(self.row.get("answer") or self.answer_of(str(self.row.get("prompt", ""))))
        return float(bool(answer) and last_integer(text) == answer)

    def call(self, arguments: dict[str, Any], name: str = "") -> dict[str, Any]:
        """An assistant's tool call in TRL's message format."""
        return {"type": "function", "function": {"name": name or self.tools[0].name, "arguments": arguments}}

    def demonstration(self, row: Mapping[str, Any], kind: str, rng: random.Random) -> list[dict[str, Any]]:
        """One conversation of `kind` ("tool", "direct", "corrected") on `row`, the tool messages the
        environment's own replies."""
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": m.content} for m in self.reset(row).messages
        ]
        calls = []
        if kind == "corrected":
            calls.append(self.wrong_call(row, rng))
        if kind in ("tool", "corrected"):
            calls.append(self.call(self.right_arguments(row)))
        for call in calls:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            text = tool_call_text(call)
            result = self.step(Action(text=text, tool_calls=parse_tool_calls(text)[0]))
            messages += [{"role": m.role, "content": m.content} for m in result.observation.messages]
        final = str(row["answer"]) if calls else self.ANSWER.format(self.guess(row, rng))
        messages.append({"role": "assistant", "content": final})
        return messages

    def right_arguments(self, row: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def guess(self, row: Mapping[str, Any], rng: random.Random) -> str:
        """A direct answer as a model without the tool writes it: a number with as many digits as the
        answer, almost never the answer. (Right direct answers would teach the tiny model to estimate the
        product from the prompt, which then competes with copying the tool's result after a call.)"""
        digits = len(str(row["answer"]).lstrip("-"))
        return str(rng.randint(10 ** (digits - 1), 10**digits - 1))

    def wrong_call(self, row: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
        """A first call that fails: a tool name that does not exist, or the argument under a wrong key."""
        right = self.right_arguments(row)
        if rng.random() < 0.5:
            return self.call(right, name=self.tools[0].name[:4])
        return self.call({"input": next(iter(right.values()))})

    def demo_mix(self, row: Mapping[str, Any]) -> tuple[float, float, float]:
        """The weights of ("tool", "direct", "corrected") for a demonstration of `row`."""
        return DEMO_MIX

    @classmethod
    def demonstrations(cls, rows: Sequence[Mapping[str, Any]], seed: int) -> list[dict[str, Any]]:
        """TRL-format SFT rows (`messages`, `tools`) for `rows`, their kinds drawn by `demo_mix(row)`."""
        rng = random.Random(seed)
        out = []
        for row in rows:
            env = cls()  # type: ignore[call-arg]  # a concrete task (a registry factory) takes no arguments
            kind = rng.choices(("tool", "direct", "corrected"), weights=env.demo_mix(row))[0]
            out.append({"messages": env.demonstration(row, kind, rng), "tools": tool_schemas(env.tools)})
        return out


def tool_call_text(call: Mapping[str, Any]) -> str:
    """A TRL tool call as the model writes it (the Hermes block the chat template renders)."""
    fn = call.get("function", call)
    return f"<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']})}\n</tool_call>"


class MultiplyEnv(FinalAnswerEnv):
    """ "a * b =" for a 3-digit a and a 2-digit b, with the calculator."""

    def __init__(self) -> None:
        super().__init__([calculator_tool()])

    def answer_of(self, prompt: str) -> str:
        try:
            return format_number(evaluate_arithmetic(prompt.strip().rstrip("=").strip()))
        except ValueError:
            return ""

    def right_arguments(self, row: Mapping[str, Any]) -> dict[str, Any]:
        return {"expression": str(row["prompt"]).rstrip("=").strip()}

    def demo_mix(self, row: Mapping[str, Any]) -> tuple[float, float, float]:
        """The demonstrator calls the calculator mostly for multipliers of 50 and more (`HARD_MIX`) and
        mostly guesses below (`EASY_MIX`), though it cannot multiply those either."""
        multiplier = int(str(row["prompt"]).split("*")[1].strip().rstrip("=").strip())
        return HARD_MIX if multiplier >= 50 else EASY_MIX

    @staticmethod
    def rows(n: int, seed: int) -> list[dict[str, str]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            out.append({"prompt": f"{a} * {b} =", "answer": str(a * b)})
        return out


class DigitSumEnv(FinalAnswerEnv):
    """ "digit sum of a ** b =" (the sum of the decimal digits of a power), with the python sandbox."""

    PATTERN = re.compile(r"digit sum of (\d+) \*\* (\d+) =")

    def __init__(self) -> None:
        super().__init__([python_tool()])

    def answer_of(self, prompt: str) -> str:
        found = self.PATTERN.fullmatch(prompt.strip())
        if not found:
            return ""
        return str(sum(int(d) for d in str(int(found[1]) ** int(found[2]))))

    def right_arguments(self, row: Mapping[str, Any]) -> dict[str, Any]:
        found = self.PATTERN.fullmatch(str(row["prompt"]).strip())
        assert found, row  # rows come from `rows`
        return {"code": f"print(sum(int(d) for d in str({found[1]} ** {found[2]})))"}

    @classmethod
    def rows(cls, n: int, seed: int) -> list[dict[str, str]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            prompt = f"digit sum of {rng.randint(2, 9)} ** {rng.randint(10, 40)} ="
            out.append({"prompt": prompt, "answer": cls().answer_of(prompt)})
        return out


class WithoutTools:
    """`env` with its tools withheld: no tools in the prompt, every call answered with an error."""

    MESSAGE = "error: no tools are available; answer directly"

    def __init__(self, env: Any) -> None:
        self.env = env
        self.tools: Sequence[ToolSpec] = ()

    def reset(self, row: Mapping[str, Any]) -> Observation:
        return self.env.reset(row)

    def step(self, action: Action) -> StepResult:
        calls = len(action.tool_calls) + len(action.malformed)
        if not calls:
            return self.env.step(action)
        messages = [Message(role="tool", content=self.MESSAGE)] * calls
        return StepResult(
            observation=Observation(messages=messages), tool_calls=calls, tool_errors=["unknown_tool"] * calls
        )


register("multiply", MultiplyEnv)
register("digit_sum", DigitSumEnv)
