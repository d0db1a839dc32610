"""Episodes batched across turns: `AgentDriver` advances each episode on its own against a real HFEngine
(continuous batching), so a slow tool holds back only its own episode, and the trajectories are the ones
the turn-synchronous driver and one-episode-at-a-time runs give."""

from __future__ import annotations

import threading

import pytest
from yatt_rollout.agent import AgentDriver
from yatt_rollout.hf_engine import HFEngine
from yatt_rollout.tiny import tiny_causal_lm, train_tokenizer
from yatt_rollout.types import GenerateRequest, Message, Observation, Prompt, SamplingParams, StepResult

CORPUS = [f"{a} + {b} = {a + b}" for a in range(20) for b in range(20)] + ["result tool user"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def engine(tok):
    model = tiny_causal_lm(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = HFEngine(model, tok, max_batch_size=64, seed=0)
    yield engine
    engine.close()


class GatedEnv:
    """Three turns. The "waiter" episode's first step blocks until the "setter" episode has finished its
    second turn (its second step opens the gate): a turn-synchronous driver, which runs every episode's
    step before anyone's next turn, can never open it, so the waiter's step times out there (an error)."""

    tools = ()

    def __init__(self, gate: threading.Event, timeout: float) -> None:
        self.gate, self.timeout, self.turn, self.role = gate, timeout, 0, ""

    def reset(self, row):
        self.role, self.turn = row["role"], 0
        return Observation(messages=[Message(role="user", content=row["prompt"])])

    def step(self, action):
        self.turn += 1
        if self.role == "setter" and self.turn == 2:
            self.gate.set()
        if self.role == "waiter" and self.turn == 1 and not self.gate.wait(self.timeout):
            raise TimeoutError("the setter never finished its second turn")
        message = Message(role="tool", content=f"result {self.turn}")
        return StepResult(observation=Observation(messages=[message]), reward=0.0, done=self.turn == 3)


def _req(rid, max_new_tokens, seed=None, temperature=0.0):
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return GenerateRequest(request_id=rid, prompt=Prompt(token_ids=[]), sampling=sampling)


def _gated_run(engine, tok, *, continuous, timeout):
    gate = threading.Event()
    driver = AgentDriver(
        engine, tok, lambda: GatedEnv(gate, timeout), max_turns=3, max_total_tokens=400, continuous=continuous
    )
    rows = [{"prompt": "3 + 4 =", "role": "waiter"}, {"prompt": "1 + 2 =", "role": "setter"}]
    return driver.run([_req("waiter", 4), _req("setter", 4)], rows)


def test_an_episode_waiting_on_another_ones_second_turn_completes(engine, tok):
    # the timeout only bounds a failure: each episode's turns go on while the other's tool blocks
    waiter, setter = _gated_run(engine, tok, continuous=True, timeout=120)
    assert [(t.num_turns, t.stop_reason, t.error) for t in (waiter, setter)] == [(3, "done", "")] * 2
    # the turn-synchronous driver cannot: the waiter's step blocks every episode's second turn, times out
    waiter, setter = _gated_run(engine, tok, continuous=False, timeout=0.3)
    assert (waiter.num_turns, waiter.stop_reason) == (1, "error")
    assert waiter.error == "environment step failed: TimeoutError: the setter never finished its second turn"
    assert (setter.num_turns, setter.stop_reason) == (3, "done")


class RepliesEnv:
    """Answers turn k with "result k"; done after 3 turns; raises at its first step on a row marked "bad"."""

    tools = ()

    def reset(self, row):
        self.turn, self.bad = 0, row.get("bad", False)
        return Observation(messages=[Message(role="user", content=row["prompt"])])

    def step(self, action):
        self.turn += 1
        if self.bad:
            raise RuntimeError("broken tool")
        message = Message(role="tool", content=f"result {self.turn}")
        return StepResult(observation=Observation(messages=[message]), reward=1.0, done=self.turn == 3)


def _key(t):
    return (t.request_id, t.index, t.token_ids, t.response_mask, t.num_turns, t.stop_reason, t.error)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trajectories_do_not_depend_on_how_episodes_are_batched(engine, tok, temperature):
    """Greedy (and seeded) episodes of unequal turn lengths, so that next turns join running batches: all
    episodes together give the trajectories of one episode at a time and of the turn-synchronous driver,
    token for token; an episode whose environment fails ends alone."""
    prompts = ["3 + 4 =", "12 - 5 =", "1 + 1 =", "7 + 8 =", "2 + 9 ="]
    reqs = [_req(f"r{i}", 3 + 4 * (i % 3), seed=i, temperature=temperature) for i in range(len(prompts))]
    rows = [{"prompt": p, "bad": i == 3} for i, p in enumerate(prompts)]
    driver = AgentDriver(engine, tok, RepliesEnv, max_turns=3, max_total_tokens=400)
    assert driver.continuous
    admitted = engine.stats["admitted_rows"]
    together = driver.run(reqs, rows)
    assert engine.stats["admitted_rows"] > admitted  # turns did join running batches
    alone = [t for req, row in zip(reqs, rows, strict=True) for t in driver.run([req], [row])]
    turn_sync = AgentDriver(engine, tok, RepliesEnv, max_turns=3, max_total_tokens=400, continuous=False)
    synced = turn_sync.run(reqs, rows)
    assert [_key(t) for t in together] == [_key(t) for t in alone] == [_key(t) for t in synced]
    assert [(t.request_id, t.num_turns, t.stop_reason) for t in together] == [
        ("r0", 3, "done"),
        ("r1", 3, "done"),
        ("r2", 3, "done"),
        ("r3", 1, "error"),
        ("r4", 3, "done"),
    ]
    assert together[3].error == "environment step failed: RuntimeError: broken tool"
    assert [len(t.token_ids) for t in together] > [0] * 5
