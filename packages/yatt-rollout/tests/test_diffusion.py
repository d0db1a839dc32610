"""The diffusion engine on a tiny SD3-style policy built from configs: per-sample seeding, eta -> 0 is the ODE
sampler, the learner's recomputed log-probs equal the engine's (ratio 1), a diffusers folder round trip."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from yatt_algos.flow_grpo import ode_step  # noqa: E402
from yatt_algos.learner.diffusion import DiffusionLearner  # noqa: E402
from yatt_algos.types import AlgoConfig, OptimConfig  # noqa: E402
from yatt_rollout.diffusion_engine import (  # noqa: E402
    DiffusionEngine,
    DiffusionSampling,
    velocity,
)
from yatt_rollout.diffusion_models import load_t2i, save_t2i, tiny_t2i, two_colour_images  # noqa: E402

PROMPTS = ["a red square on the left", "a blue square on the top", "a green square on the right"]


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return tiny_t2i(PROMPTS * 4, image_size=16, hidden_size=32, seed=0)


def _batch(rollout, advantages):
    return {
        "latents": rollout.latents,
        "next_latents": rollout.next_latents,
        "old_logprobs": rollout.logprobs,
        "sigmas": rollout.sigmas,
        "next_sigmas": rollout.next_sigmas,
        "advantages": advantages,
        "cond": {"embeds": rollout.embeds, "pooled": rollout.pooled},
    }


def test_each_image_is_seeded_alone(policy) -> None:
    engine = DiffusionEngine(policy, DiffusionSampling(num_steps=4, eta=0.7, image_size=16))
    both = engine.generate(PROMPTS[:2], [11, 12])
    alone = engine.generate(PROMPTS[1:2], [12])
    assert both.images.shape == (2, 16, 16, 3) and both.latents.shape == (2, 4, 4, 8, 8)
    assert (both.images[1] == alone.images[0]).all()
    assert torch.allclose(both.logprobs[1], alone.logprobs[0], atol=1e-5)
    again = engine.generate(PROMPTS[:2], [11, 12])
    assert torch.equal(again.next_latents, both.next_latents)


def test_eta_zero_is_the_euler_ode_sampler(policy) -> None:
    spec = DiffusionSampling(num_steps=5, eta=0.0, shift=3.0, image_size=16)
    engine = DiffusionEngine(policy, spec)
    out = engine.generate(PROMPTS[:1], [3])
    x = out.latents[:, 0]  # the seeded starting noise
    cond = engine.conditioning(PROMPTS[:1])
    with torch.no_grad():
        for k in range(5):
            v = velocity(policy.transformer, x, engine.sigmas[k], cond)
            x = ode_step(x, v, engine.sigmas[k], engine.sigmas[k + 1])
            assert torch.allclose(out.next_latents[:, k], x, atol=1e-5)
    near = DiffusionEngine(policy, DiffusionSampling(num_steps=5, eta=1e-5, image_size=16)).generate(
        PROMPTS[:1], [3]
    )
    assert float((near.next_latents - out.next_latents).abs().max()) < 1e-3


def test_learner_recomputes_the_engines_logprobs(policy) -> None:
    spec = DiffusionSampling(num_steps=4, eta=0.7, image_size=16, num_train_steps=3)
    engine = DiffusionEngine(policy, spec)
    out = engine.generate(PROMPTS, [1, 2, 3])
    assert out.logprobs.shape == (3, 3) and torch.equal(out.sigmas, torch.tensor(engine.sigmas[:3]))
    full = DiffusionEngine(policy, DiffusionSampling(num_steps=4, eta=0.7, image_size=16)).generate(
        PROMPTS, [1, 2, 3]
    )
    assert torch.allclose(full.logprobs[:, :3], out.logprobs, atol=1e-6)  # the subset is the first steps
    learner = DiffusionLearner(
        policy.transformer,
        functools.partial(velocity, guidance_scale=1.0),
        algo=AlgoConfig(),
        optim=OptimConfig(lr=1e-3, micro_batch_size=3),
        eta=0.7,
        sigma_max=engine.sigmas[1],
    )
    recomputed = learner.logprobs(_batch(out, torch.zeros(3)))
    assert torch.allclose(recomputed, out.logprobs, atol=1e-5)
    assert float((recomputed - out.logprobs).exp().sub(1).abs().max()) < 1e-5  # the on-policy ratio is 1


def test_guidance_mixes_conditional_and_empty_prompt_velocities(policy) -> None:
    engine = DiffusionEngine(policy, DiffusionSampling(num_steps=2, guidance_scale=3.0, image_size=16))
    cond = engine.conditioning(PROMPTS[:2])
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        guided = velocity(policy.transformer, x, 0.5, cond, 3.0)
        plain = velocity(policy.transformer, x, 0.5, cond)
        empty = velocity(
            policy.transformer, x, 0.5, {"embeds": cond["neg_embeds"], "pooled": cond["neg_pooled"]}
        )
    assert torch.allclose(guided, empty + 3.0 * (plain - empty), atol=1e-5)


def test_update_raises_the_logprob_of_the_rewarded_image(policy) -> None:
    import copy

    model = copy.deepcopy(policy.transformer)
    engine = DiffusionEngine(policy, DiffusionSampling(num_steps=3, eta=0.7, image_size=16))
    out = engine.generate(PROMPTS[:2], [5, 6])
    learner = DiffusionLearner(
        model,
        functools.partial(velocity, guidance_scale=1.0),
        algo=AlgoConfig(),
        optim=OptimConfig(lr=1e-3, micro_batch_size=1, num_training_steps=10),
        eta=0.7,
        sigma_max=engine.sigmas[1],
    )
    batch = _batch(out, torch.tensor([1.0, -1.0]))
    stats = learner.update(batch)
    after = learner.logprobs(batch)
    assert stats["loss"] == pytest.approx(0.0, abs=1e-6)  # ratio 1 at the first pass: -mean(A) = 0
    assert after[0].sum() > out.logprobs[0].sum() and after[1].sum() < out.logprobs[1].sum()
    state = learner.state()
    other = DiffusionLearner(
        copy.deepcopy(policy.transformer),
        functools.partial(velocity, guidance_scale=1.0),
        algo=AlgoConfig(),
        optim=OptimConfig(lr=1e-3, micro_batch_size=1, num_training_steps=10),
        eta=0.7,
        sigma_max=engine.sigmas[1],
    )
    other.load_state(state)
    assert torch.equal(other.logprobs(batch), after) and other.num_steps == 1


def test_diffusers_folder_round_trip(policy, tmp_path) -> None:
    spec = DiffusionSampling(num_steps=2, eta=0.5, image_size=16)
    folder = save_t2i(policy, tmp_path / "t2i")
    assert sorted(p.name for p in folder.iterdir()) == [
        "model_index.json",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    ]
    loaded = load_t2i(folder)
    a = DiffusionEngine(policy, spec).generate(PROMPTS, [7, 8, 9])
    b = DiffusionEngine(loaded, spec).generate(PROMPTS, [7, 8, 9])
    assert (a.images == b.images).all() and torch.allclose(a.logprobs, b.logprobs)
    with pytest.raises(ValueError, match=r"no model_index\.json"):
        load_t2i(tmp_path)


def test_bad_sampling_settings_are_named() -> None:
    with pytest.raises(ValueError, match="num_train_steps must be in"):
        DiffusionSampling(num_steps=4, num_train_steps=5)
    with pytest.raises(ValueError, match="guidance_scale must be >= 1"):
        DiffusionSampling(guidance_scale=0.5)


def test_image_size_must_fit_the_vae_and_patch(policy) -> None:
    with pytest.raises(ValueError, match="image_size 18 is not a multiple of 4"):
        DiffusionEngine(policy, DiffusionSampling(image_size=18))


def test_two_colour_images_split_in_two_colours() -> None:
    images = two_colour_images(6, 16, torch.Generator().manual_seed(0))
    assert images.shape == (6, 3, 16, 16) and images.min() >= -1 and images.max() <= 1
    for image in images:
        assert len(torch.unique(image.reshape(3, -1), dim=1).T) == 2
