"""CAPO: voting over K critiques, step spans to tokens, token rewards, group normalization over tokens."""

import pytest
import torch
from yatt_algos.capo import (
    capo_advantages,
    capo_token_rewards,
    char_spans_to_token_spans,
    split_steps,
    vote_wrong_steps,
)

# K = 3 critiques: step 1 flagged once, step 2 by all three, step 3 once
CRITIQUES = [{1, 2}, {2}, {2, 3}]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("intersection", {2: 1.0}),
        ("majority", {2: 1.0}),  # count > 3 / 2, i.e. >= 2
        ("union", {1: 1.0, 2: 1.0, 3: 1.0}),
        ("average", {1: 1 / 3, 2: 1.0, 3: 1 / 3}),
    ],
)
def test_voting_hand_worked(mode, expected):
    got = vote_wrong_steps(CRITIQUES, mode)
    assert got.keys() == expected.keys()
    assert list(got.values()) == pytest.approx(list(expected.values()))


def test_majority_is_strict():
    # K = 4: step 0 flagged by 2 = K / 2 is not a strict majority; step 1 by 3 is
    assert vote_wrong_steps([{0, 1}, {0, 1}, {1}, set()], "majority") == {1: 1.0}


def test_voting_bad_input():
    with pytest.raises(ValueError, match=r"critiques is empty \(K=0\)"):
        vote_wrong_steps([], "union")
    with pytest.raises(ValueError, match=r"mode 'vote' is not one of"):
        vote_wrong_steps(CRITIQUES, "vote")
    with pytest.raises(ValueError, match=r"critiques\[1\] flags step 5, outside 0..3"):
        vote_wrong_steps([{0}, {5}], "union", num_steps=4)


def test_split_steps_and_token_spans():
    text = "Step 1: x = 2\nStep 2: y = 3\n\nSo z = 5"
    spans = split_steps(text)
    assert [text[s:e] for s, e in spans] == ["Step 1: x = 2", "Step 2: y = 3", "So z = 5"]
    # tokens: "Step 1:"(0,7) " x = 2"(7,13) "\n"(13,14) "Step 2: y = 3"(14,27) "\n\n"(27,29) "So"(29,31) " z = 5"(31,37)
    offsets = [(0, 7), (7, 13), (13, 14), (14, 27), (27, 29), (29, 31), (31, 37)]
    assert char_spans_to_token_spans(spans, offsets) == [(0, 2), (3, 4), (5, 7)]


def test_token_rewards_hand_worked():
    # row 0 correct (r_v = 1), steps at tokens [1, 3) and [3, 6), step 1 wrong: 2 on [1, 3), 2 - 1 = 1 on [3, 6)
    # row 1 wrong (r_v = 0), step 0 wrong with average weight 0.5: -0.5 on [1, 3), 0 on [3, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    spans = [[(1, 3), (3, 6)], [(1, 3), (3, 5)]]
    out = capo_token_rewards(torch.tensor([1.0, 0.0]), spans, [{1: 1.0}, {0: 0.5}], mask)
    torch.testing.assert_close(
        out, torch.tensor([[0.0, 2.0, 2.0, 1.0, 1.0, 1.0], [0.0, -0.5, -0.5, 0.0, 0.0, 0.0]])
    )


def test_token_rewards_bad_input():
    mask = torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"wrong_steps\[0\] names step 2, but row 0 has 1 steps"):
        capo_token_rewards(torch.tensor([1.0]), [[(0, 4)]], [{2: 1.0}], mask)
    with pytest.raises(ValueError, match=r"step_spans\[0\]\[0\] = \(0, 9\) is outside 0..4"):
        capo_token_rewards(torch.tensor([1.0]), [[(0, 9)]], [{0: 1.0}], mask)
    with pytest.raises(ValueError, match=r"verifier_rewards must have shape \(1,\), got \(2,\)"):
        capo_token_rewards(torch.tensor([1.0, 0.0]), [[(0, 4)]], [{}], mask)


def test_group_normalization_over_tokens_hand_worked():
    # one group, tokens 2, 2, 1 (row 0) and -1, 0 (row 1): mean 0.8, unbiased var
    # (1.2^2 * 2 + 0.2^2 + 1.8^2 + 0.8^2) / 4 = 6.8 / 4 = 1.7, std 1.303840
    rewards = torch.tensor([[2.0, 2.0, 1.0], [-1.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = capo_advantages(rewards, mask, torch.tensor([3, 3]))
    expected = torch.tensor([[0.920358, 0.920358, 0.153393], [-1.380537, -0.613572, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    # a second, separate group is normalized on its own; all-equal tokens give 0, not NaN
    adv2 = capo_advantages(
        torch.cat([rewards, torch.full((1, 3), 2.0)]),
        torch.cat([mask, torch.ones(1, 3)]),
        torch.tensor([3, 3, 8]),
    )
    torch.testing.assert_close(adv2[:2], expected, rtol=1e-5, atol=1e-5)
    assert adv2[2].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"response_mask rows \[1\] are all masked"):
        capo_advantages(rewards, torch.tensor([[1, 1, 1], [0, 0, 0]]), torch.tensor([3, 3]))
