"""Routing replay (R2/R3) in the torch learner on a tiny Qwen3-MoE built from a config: with replay the MoE
layers use exactly the given experts (a hook asserts it) and the router still gets gradients; without replay a
perturbed router chooses differently and `moe/routing_agreement` sees it; the load-balancing loss matches its
formula. One model for the module."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from yatt_algos.learner.routing import (
    RouterHooks,
    agreement,
    load_balancing_loss,
    moe_routers,
    replayed_weights,
    routes_to_batch,
)
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import AlgoConfig, OptimConfig

B, T = 4, 10


@pytest.fixture(scope="module")
def moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).float().eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 7:] = False  # right padding on one row
    response = mask.clone()
    response[:, :4] = False
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def _own(model, batch):
    with RouterHooks(model) as hooks, torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long())
    return hooks.own.view(B, T, *hooks.own.shape[1:])


def _different_routes(own):
    """Each choice shifted by one expert: never the same pair as `own` (4 experts, top-2)."""
    return (own + 1) % 4


def _learner(model, **algo):
    return TorchPolicyLearner(
        copy.deepcopy(model), algo=AlgoConfig(**algo), optim_config=OptimConfig(lr=1e-2, micro_batch_size=2)
    )


def test_replay_uses_exactly_the_given_experts(moe):
    batch = _batch()
    given = _different_routes(_own(moe, batch))
    learner = _learner(moe, routing_replay="r3")
    used = []
    blocks = [m for m in learner.model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    handles = [
        b.experts.register_forward_pre_hook(lambda m, args: used.append(args[1].clone())) for b in blocks
    ]
    learner.compute_logprobs({**batch, "routed_experts": given})
    for h in handles:
        h.remove()
    # micro-batches of 2 rows (each as wide as its longest row: 10), 2 layers each: the experts' top_k_index
    # is the given ids of those rows at every position, padding included
    expected = [given[rows][:, :, layer].reshape(-1, 2) for rows in ([0, 1], [2, 3]) for layer in (0, 1)]
    assert len(used) == 4
    for got, want in zip(used, expected, strict=True):
        assert torch.equal(got, want)


def test_replay_with_own_choice_is_the_plain_forward_and_router_gets_gradients(moe):
    batch = _batch()
    own = _own(moe, batch)
    plain = _learner(moe).compute_logprobs(batch)
    replayed = _learner(moe, routing_replay="r3").compute_logprobs({**batch, "routed_experts": own})
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    model = copy.deepcopy(moe)
    given = _different_routes(own).reshape(B * T, 2, 2)
    with RouterHooks(model, given.view(B, T, 2, 2)):
        out = model(input_ids=batch["input_ids"]).logits
    out.float().logsumexp(-1).sum().backward()
    grads = [r.weight.grad for r in moe_routers(model)]
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_replayed_weights_are_softmax_at_the_given_experts_renormalized():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)
    w = replayed_weights(logits, torch.tensor([[3, 1]]), renormalize=True)
    expected = probs[0, [3, 1]] / probs[0, [3, 1]].sum()
    torch.testing.assert_close(w[0], expected)
    torch.testing.assert_close(replayed_weights(logits, torch.tensor([[0, 2]]), False)[0], probs[0, [0, 2]])


def test_perturbed_router_changes_choices_and_the_agreement_metric_sees_it(moe):
    batch = _batch()
    rollout = _own(moe, batch)  # the "engine": the unperturbed router
    learner = _learner(moe)  # routing_replay off: own choices, agreement only measured
    same = learner.compute_old_logprobs({**batch, "routed_experts": rollout})
    valid = same["routing_valid"].bool()
    assert float(same["routing_agreement"][valid].mean()) == 1.0
    assert torch.equal(
        same["routed_experts"][batch["attention_mask"]], rollout[batch["attention_mask"]].to(torch.int16)
    )
    with torch.no_grad():
        for router in moe_routers(learner.model):
            router.weight.add_(0.5 * torch.randn_like(router.weight))
    moved = learner.compute_old_logprobs({**batch, "routed_experts": rollout})
    share = float(moved["routing_agreement"][valid].mean())
    own = moved["routed_experts"].long()
    flips = agreement(own.reshape(-1, 2, 2), rollout.reshape(-1, 2, 2))[0].view(B, T)
    assert 0.0 < share < 1.0
    # position t reports the routing of position t - 1 (the forward that predicted token t)
    expected = flips[:, :-1][valid[:, 1:]].mean()
    assert share == pytest.approx(float(expected), abs=1e-6)


def test_update_reports_agreement_and_router_aux_and_trains_the_router(moe):
    batch = _batch()
    rollout = _own(moe, batch)
    learner = _learner(moe, routing_replay="r3", router_aux_coef=0.1)
    old = learner.compute_logprobs({**batch, "routed_experts": rollout})
    before = [r.weight.detach().clone() for r in moe_routers(learner.model)]
    stats = learner.update(
        {
            **batch,
            "routed_experts": rollout,
            "old_logprobs": old,
            "advantages": torch.linspace(-1, 1, B)[:, None].expand(B, T),
        }
    )
    assert stats.metrics["moe/routing_agreement"] == 1.0
    assert stats.metrics["moe/router_aux"] >= 1.0  # E * sum f P >= 1, equality at a uniform load
    after = [r.weight for r in moe_routers(learner.model)]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_load_balancing_loss_formula():
    logits = [torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])]
    valid = torch.tensor([True, True, False])
    probs = torch.softmax(logits[0][:2], -1)
    # top-1 picks expert 0 then expert 1: f = [0.5, 0.5, 0, 0]
    expected = 4 * (torch.tensor([0.5, 0.5, 0.0, 0.0]) * probs.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss(logits, 1, valid), expected)


def test_routes_to_batch_pads_with_minus_one_and_bad_shapes_are_named():
    out = routes_to_batch([torch.ones(3, 2, 2, dtype=torch.long), None], width=4, layers=2, top_k=2)
    assert (
        out.shape == (2, 4, 2, 2)
        and out[0, :3].eq(1).all()
        and out[0, 3].eq(-1).all()
        and out[1].eq(-1).all()
    )
    learner = _learner_dense()
    assert learner.moe is False
    with pytest.raises(ValueError, match="routed_experts has shape"):
        from yatt_algos.learner.routing import split_routes

        split_routes(
            {"input_ids": torch.zeros(2, 5, dtype=torch.long), "routed_experts": torch.zeros(2, 4, 2, 2)}
        )


def _learner_dense():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return TorchPolicyLearner(Qwen2ForCausalLM(config), algo=AlgoConfig(), optim_config=None)
