"""Per-row sampling: top-k/top-p filters worked by hand, greedy rows, seeded rows, raw logprobs."""

import math

import pytest

torch = pytest.importorskip("torch")

from yatt_rollout.sampling import (  # noqa: E402
    filter_logits,
    inverse_cdf,
    raw_logprobs,
    row_params,
    sample,
    sample_from,
    uniform_draws,
)

# probabilities 0.5, 0.25, 0.15, 0.1 (log of them are the logits)
LOGITS = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.15), math.log(0.1)]])
NEG = float("-inf")


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (0, 1.0, [True, True, True, True]),
        (2, 1.0, [True, True, False, False]),
        # mass above each sorted token: 0, 0.5, 0.75, 0.9; keep where it is < p
        (0, 0.5, [True, False, False, False]),
        (0, 0.6, [True, True, False, False]),
        (0, 0.8, [True, True, True, False]),
        (3, 0.6, [True, True, False, False]),  # both filters: the stricter wins
        (1, 1.0, [True, False, False, False]),
    ],
)
def test_filters_by_hand(top_k, top_p, kept):
    out = filter_logits(LOGITS, torch.tensor([top_k]), torch.tensor([top_p]))
    assert (out[0] > NEG).tolist() == kept
    assert torch.equal(out[0][out[0] > NEG], LOGITS[0][torch.tensor(kept)])


def test_rows_filter_independently():
    logits = LOGITS.repeat(2, 1)
    out = filter_logits(logits, torch.tensor([1, 0]), torch.tensor([1.0, 0.8]))
    assert (out > NEG).sum(-1).tolist() == [1, 3]


def test_greedy_and_seeded_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = row_params([0.0, 1.0, 1.0, 1.0], [0, 0, 0, 5], [1.0, 1.0, 1.0, 0.9])
    g = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    first = sample(logits, params, g, torch.Generator().manual_seed(9))
    g2 = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    again = sample(logits, params, g2, torch.Generator().manual_seed(123))
    assert first[0] == logits[0].argmax()  # temperature 0: argmax
    assert first[1] == again[1] and first[3] == again[3]  # seeded rows ignore the shared generator
    assert first[3] in logits[3].topk(5).indices  # top-k 5 respected


def test_sampling_matches_the_filtered_distribution():
    # top_p 0.8 keeps tokens 0..2 with renormalized probabilities 0.5/0.9, 0.25/0.9, 0.15/0.9
    logits = LOGITS.repeat(20000, 1)
    params = row_params([1.0] * 20000, [0] * 20000, [0.8] * 20000)
    tokens = sample(logits, params, [None] * 20000, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.25, 0.15]) / 0.9, atol=0.015, rtol=0)


def test_seeded_rows_match_the_filtered_distribution_and_their_seed():
    # top_p 0.8 keeps tokens 0..2 with renormalized probabilities 0.5/0.9, 0.25/0.9, 0.15/0.9; every row seeded
    n = 20000
    logits = LOGITS.repeat(n, 1)
    params = row_params([1.0] * n, [0] * n, [0.8] * n)
    tokens = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(n)], torch.Generator())
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.25, 0.15]) / 0.9, atol=0.015, rtol=0)
    # a row's token is the first whose cumulative probability exceeds its generator's uniform draw
    u = torch.rand(1, generator=torch.Generator().manual_seed(7), dtype=torch.float64).item()
    want = int((torch.tensor([0.5, 0.75, 0.9]) / 0.9 <= u).sum())
    assert sample(logits[:1], row_params([1.0], [0], [0.8]), [torch.Generator().manual_seed(7)], None) == want


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for seed in range(200):
        gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)]
        first, second = inverse_cdf(probs, uniform_draws(gens)).tolist()
        assert first in (1, 2) and second == 0
    assert inverse_cdf(probs, uniform_draws([torch.Generator().manual_seed(0)] * 2)).dtype == torch.int64


def test_a_block_of_draws_is_the_same_stream_as_one_draw_per_token():
    """`LiveRows` draws each seeded row's uniforms for its whole budget at once: on the CPU the block is the
    numbers one draw per step would give, so a row samples the same tokens either way."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    params = row_params([1.0, 0.7, 0.0], [0, 10, 0], [1.0, 0.9, 1.0])
    seeds = [torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(12)]
    block = uniform_draws(seeds, 5)
    assert block.shape == (3, 5) and block.dtype == torch.float64 and block[1].eq(0).all()
    singles = [torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(12)]
    for step in range(5):
        one = sample(logits, params, singles, torch.Generator().manual_seed(step))
        many = sample_from(
            logits, params, [True, False, True], block[:, step], torch.Generator().manual_seed(step)
        )
        assert torch.equal(one, many)


def test_raw_logprobs_ignore_temperature():
    assert raw_logprobs(LOGITS, torch.tensor([2])).item() == pytest.approx(math.log(0.15), abs=1e-6)
