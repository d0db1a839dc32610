"""Tools in the prompt and the tasks that need them: the tiny template renders tools as Qwen2.5's does and
plain chats exactly as before, a conversation's SFT layout equals the episode's, the embedded environments'
rows, rewards and demonstrations, and tools withheld. Tokenizer-only (milliseconds), except the one test
that runs the tiny model (token identity on the embedded task)."""

from __future__ import annotations

import json
import random

import pytest
from yatt_rollout.agent import AgentDriver, TurnCodec
from yatt_rollout.env import ENVIRONMENTS, parse_tool_calls, tool_schemas
from yatt_rollout.tiny import LEGACY_CHAT_TEMPLATE, train_tokenizer
from yatt_rollout.tool_tasks import (
    EASY_MIX,
    HARD_MIX,
    DigitSumEnv,
    MultiplyEnv,
    WithoutTools,
    tool_call_text,
)
from yatt_rollout.types import Action, GenerateRequest, Message, Prompt, SamplingParams, ToolCall

CORPUS = [json.dumps(d) for d in MultiplyEnv.demonstrations(MultiplyEnv.rows(40, 0), 0)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=600)


def test_plain_chats_render_as_before(tok):
    legacy = train_tokenizer(CORPUS, vocab_size=600, chat_template=LEGACY_CHAT_TEMPLATE)
    chats = [
        [{"role": "user", "content": "3 + 4 ="}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 4 ="}],
        [
            {"role": "user", "content": "1 ="},
            {"role": "assistant", "content": "1"},
            {"role": "user", "content": "x"},
        ],
    ]
    for chat in chats:
        for generation in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
            assert ours == legacy.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)


def test_tools_render_as_qwen(tok):
    schemas = tool_schemas(MultiplyEnv().tools)
    chat = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "12 * 34 ="},
        {"role": "assistant", "content": "", "tool_calls": [MultiplyEnv().call({"expression": "12 * 34"})]},
        {"role": "tool", "content": "408"},
        {"role": "tool", "content": "409"},
        {"role": "assistant", "content": "The answer is 408."},
    ]
    text = tok.apply_chat_template(chat, tools=schemas, tokenize=False)
    # Qwen2.5's layout (its default system sentence aside): tools after the system text, calls as Hermes
    # blocks, consecutive tool messages one user turn
    assert text == (
        "<|im_start|>system\nSys\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(schemas[0])
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\n12 * 34 =<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n409"
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer is 408.<|im_end|>\n"
    )
    # what the model writes for a call is what the template renders and what the parser reads back
    call = tool_call_text(MultiplyEnv().call({"expression": "12 * 34"}))
    assert call in text
    assert parse_tool_calls(call) == ([ToolCall(name="calculator", arguments={"expression": "12 * 34"})], [])


def test_conversation_layout_is_the_episode_layout(tok):
    """The SFT ids of a demonstration are the template's text token for token, the mask is 1 exactly on
    the assistant turns (through their eos), and the pieces are the episode's: prompt_ids with the tools,
    then the model's turn, then reply_ids of the tool messages."""
    codec = TurnCodec(tok)
    env = MultiplyEnv()
    demo = env.demonstration({"prompt": "12 * 34 =", "answer": "408"}, "corrected", random.Random(1))
    ids, mask = codec.conversation_ids(demo, env.tools)
    text = tok.apply_chat_template(demo, tools=tool_schemas(env.tools), tokenize=False)
    assert ids == tok.encode(text.removesuffix("\n"), add_special_tokens=False)
    turns = [m for m in demo if m["role"] == "assistant"]
    own = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert own == "".join(
        (tool_call_text(m["tool_calls"][0]) if m.get("tool_calls") else m["content"]) + "<|im_end|>"
        for m in turns
    )
    prompt = codec.prompt_ids([Message(role="user", content="12 * 34 =")], env.tools)
    first = codec.assistant_ids(demo[1])
    reply = codec.reply_ids([Message(role="tool", content=demo[2]["content"])])
    assert ids[: len(prompt) + len(first) + len(reply)] == prompt + first + reply
    assert mask[: len(prompt) + len(first) + len(reply)] == [0] * len(prompt) + [1] * len(first) + [0] * len(
        reply
    )
    with pytest.raises(ValueError, match="conversation has no assistant message"):
        codec.conversation_ids(demo[:1])


def test_multiply_env_scores_and_corrects():
    env = MultiplyEnv()
    assert [r["answer"] for r in MultiplyEnv.rows(2, 0)] == [
        str(eval(r["prompt"][:-1])) for r in MultiplyEnv.rows(2, 0)
    ]
    env.reset({"prompt": "347 * 86 ="})  # no answer: the prompt's own value (29842)
    call = env.step(
        Action(text="", tool_calls=[ToolCall(name="calculator", arguments={"expression": "347 * 86"})])
    )
    assert (call.done, call.tool_calls, call.observation.messages[0].content) == (False, 1, "29842")
    assert env.step(Action(text="29842")).reward == 1.0 and env.step(Action(text="29843")).reward == 0.0
    demo = env.demonstration({"prompt": "347 * 86 =", "answer": "29842"}, "corrected", random.Random(0))
    # the wrong first call's error is the environment's own message, then the right call, then the answer
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert demo[2]["content"].startswith("error: ") and demo[4]["content"] == "29842"


def test_multiply_demonstrations_call_mostly_for_large_multipliers_and_guess_otherwise():
    rows = MultiplyEnv.rows(800, 1)
    demos = MultiplyEnv.demonstrations(rows, 1)
    for large, mix in ((True, HARD_MIX), (False, EASY_MIX)):
        kinds = [
            len(d["messages"])
            for r, d in zip(rows, demos, strict=True)
            if (int(r["prompt"][6:8]) >= 50) == large
        ]
        shares = [kinds.count(n) / len(kinds) for n in (4, 2, 6)]  # tool, direct, corrected
        assert all(abs(s - w) < 0.07 for s, w in zip(shares, mix, strict=True)), (large, shares)
    # a direct answer is a guess with the answer's digit count, not the answer (a model without the tool)
    direct = [
        (r, d["messages"][1]["content"]) for r, d in zip(rows, demos, strict=True) if len(d["messages"]) == 2
    ]
    guesses = [c.removeprefix("The answer is ").removesuffix(".") for _, c in direct]
    assert all(len(g) == len(r["answer"]) and g.isdigit() for (r, _), g in zip(direct, guesses, strict=True))
    assert sum(g == r["answer"] for (r, _), g in zip(direct, guesses, strict=True)) <= 1
    # after a call, the answer is the tool's result as it came back
    called = [d["messages"] for d in demos if len(d["messages"]) >= 4]
    assert all(m[-1]["content"] == m[-2]["content"] for m in called)
    assert MultiplyEnv.demonstrations(rows[:20], 1) == demos[:20]  # seeded


def test_digit_sum_env_runs_the_sandbox():
    env = DigitSumEnv()
    assert env.answer_of("digit sum of 2 ** 10 =") == "7"
    demo = env.demonstration({"prompt": "digit sum of 2 ** 10 =", "answer": "7"}, "tool", random.Random(0))
    assert demo[2] == {"role": "tool", "content": "7\n"}  # the program ran in the sandbox
    assert env.step(Action(text="7")).reward == 1.0
    assert set(ENVIRONMENTS) >= {"multiply", "digit_sum"}


def test_without_tools_answers_every_call_with_an_error():
    env = WithoutTools(MultiplyEnv())
    assert list(env.tools) == []
    env.reset({"prompt": "347 * 86 =", "answer": "29842"})
    call = ToolCall(name="calculator", arguments={"expression": "347 * 86"})
    result = env.step(Action(text="", tool_calls=[call], malformed=["bad"]))
    assert [m.content for m in result.observation.messages] == [WithoutTools.MESSAGE] * 2
    assert (result.tool_calls, result.tool_errors, result.done) == (2, ["unknown_tool"] * 2, False)
    assert env.step(Action(text="29842")).reward == 1.0


def test_token_in_token_out_on_the_embedded_task(tok):
    """A sampling tiny model writes token sequences that are not the tokenizer's own encoding of their
    text: a decode/re-encode round trip would change them. The trajectory keeps the engine's ids."""
    import torch
    from yatt_rollout.hf_engine import HFEngine
    from yatt_rollout.tiny import tiny_causal_lm

    model = tiny_causal_lm(len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    engine = HFEngine(model, tok, max_batch_size=64, seed=0)
    sent = []

    class Spy:
        policy_version = 0

        def generate(self, requests):
            got = engine.generate(requests)
            sent.append(got)
            return got

    try:
        driver = AgentDriver(Spy(), tok, MultiplyEnv, max_turns=1, max_total_tokens=512)
        sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3)
        reqs = [GenerateRequest(request_id="p0", prompt=Prompt(token_ids=[]), sampling=sampling)]
        trajectories = driver.run(reqs, [{"prompt": "347 * 86 ="}])
    finally:
        engine.close()
    assert [t.token_ids for t in trajectories] == [c.token_ids for c in sent[0]]
    round_trip = [tok.encode(tok.decode(t.token_ids), add_special_tokens=False) for t in trajectories]
    assert any(r != t.token_ids for r, t in zip(round_trip, trajectories, strict=True))
    assert torch.tensor([len(t.token_ids) for t in trajectories]).gt(0).all()
