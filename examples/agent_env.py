"""An environment and its tool in one file, for agentic GRPO (`yatt grpo --set rollout.env=...`).

    PYTHONPATH=examples yatt grpo --set rollout.env=agent_env:LetterCountEnv --set rollout.max_turns=3 \
        --set rollout.tools_in_prompt=true --set model.max_position_embeddings=1024

The tool is a JSON-schema function (`ToolSpec`, what the prompt shows: the chat template renders it with
`apply_chat_template(..., tools=...)`) and a Python function from its arguments to a `ToolResult`; the
environment declares its tools once (`ToolEnvironment.__init__`), and the same list is what the prompt
lists, what the Hermes `<tool_call>` parser's calls are dispatched to, and what `rows`/`demonstrations`
(optional: the job's own data and the multi-turn SFT warm start, `rollout.sft_steps`) use. A turn with tool
calls gets one tool message per call (errors included, counted by kind); a turn without calls is the
answer, scored by `score`.

`main()` shows the round trip without a model: the prompt with the tool rendered, then a scripted policy
(a stand-in that writes fixed turns, named as such) calls the tool and answers; it prints the episode as
JSON on its last line.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from yatt_rollout.env import ToolEnvironment
from yatt_rollout.tool_tasks import FinalAnswerEnv
from yatt_rollout.tools import Tool
from yatt_rollout.types import ToolResult, ToolSpec

WORDS = ["strawberry", "bookkeeper", "mississippi", "committee", "balloon", "success", "parallel"]


def letter_count_tool() -> Tool:
    """Counts a letter in a word: what a tokenizer-blind model cannot see."""
    spec = ToolSpec(
        name="count_letters",
        description="Count how many times a letter occurs in a word.",
        parameters={
            "type": "object",
            "properties": {"word": {"type": "string"}, "letter": {"type": "string"}},
            "required": ["word", "letter"],
        },
    )

    def run(arguments: dict[str, Any]) -> ToolResult:
        word, letter = arguments.get("word"), arguments.get("letter")
        if not isinstance(word, str) or not isinstance(letter, str) or len(letter) != 1:
            return ToolResult(status="malformed", output="count_letters: needs a word and a single letter")
        return ToolResult(status="ok", output=str(word.count(letter)))

    return Tool(spec, run)


class LetterCountEnv(FinalAnswerEnv):
    """ "How many r in strawberry?": the answer is the last integer of the final turn."""

    def __init__(self) -> None:
        ToolEnvironment.__init__(self, [letter_count_tool()])

    def answer_of(self, prompt: str) -> str:
        letter, word = prompt.removeprefix("How many ").removesuffix("?").split(" in ")
        return str(word.count(letter))

    def right_arguments(self, row: dict[str, Any]) -> dict[str, Any]:
        letter, word = str(row["prompt"]).removeprefix("How many ").removesuffix("?").split(" in ")
        return {"word": word, "letter": letter}

    @classmethod
    def rows(cls, n: int, seed: int) -> list[dict[str, str]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            word = rng.choice(WORDS)
            prompt = f"How many {rng.choice(sorted(set(word)))} in {word}?"
            out.append({"prompt": prompt, "answer": cls().answer_of(prompt)})
        return out


class ScriptedPolicy:
    """A stand-in engine (no model): turn k writes `turns[k]`, ending with eos."""

    policy_version = 0

    def __init__(self, tok: Any, turns: list[str]) -> None:
        self.tok, self.turns, self.turn = tok, turns, 0

    def generate(self, requests: list) -> list:
        from yatt_rollout.types import Completion

        ids = [*self.tok.encode(self.turns[self.turn], add_special_tokens=False), self.tok.eos_token_id]
        self.turn += 1
        return [
            Completion(
                request_id=r.request_id,
                index=0,
                token_ids=ids,
                logprobs=[0.0] * len(ids),
                finish_reason="stop",
                policy_version=0,
            )
            for r in requests
        ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from yatt_rollout.agent import AgentDriver, TurnCodec
    from yatt_rollout.tiny import train_tokenizer
    from yatt_rollout.tool_tasks import tool_call_text
    from yatt_rollout.types import GenerateRequest, Message, Prompt, SamplingParams

    row = {"prompt": "How many r in strawberry?", "answer": "3"}
    env = LetterCountEnv()
    tok = train_tokenizer([json.dumps(d) for d in env.demonstrations(env.rows(50, 0), 0)], vocab_size=600)
    prompt = tok.decode(TurnCodec(tok).prompt_ids([Message(role="user", content=row["prompt"])], env.tools))
    call = tool_call_text(env.call(env.right_arguments(row)))
    policy = ScriptedPolicy(tok, [call, "There are 3."])
    driver = AgentDriver(policy, tok, LetterCountEnv, max_turns=3, max_total_tokens=2048)
    request = GenerateRequest(request_id="q", prompt=Prompt(token_ids=[]), sampling=SamplingParams())
    (episode,) = driver.run([request], [row])
    result = {
        "tools_in_prompt": '"name": "count_letters"' in prompt,
        "episode": tok.decode(episode.token_ids),
        "reward": episode.reward,
        "turns": episode.num_turns,
        "tool_calls": episode.tool_calls,
        "tool_errors": episode.tool_errors,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
