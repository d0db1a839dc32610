"""GenPRM's pure parts: step splitting, the wrong-step parser and step spans -> token spans, by hand."""

import pytest
from yatt_multimodal.genprm import number_steps, parse_wrong_steps, split_steps, token_spans


def test_split_on_blank_lines():
    text = "  a = 2\n\nb = 3\n \n\nso 5\n"
    spans = split_steps(text)
    assert [text[s:e] for s, e in spans] == ["a = 2", "b = 3", "so 5"]
    assert spans == [(2, 7), (9, 14), (18, 22)]
    assert split_steps("   \n\n  ") == []


def test_split_on_step_markers():
    text = "Plan first.<step 1> a = 2 </step 1>\n<step 2>b = 3\n\nstill step 2<step 3>so 5"
    steps = [text[s:e] for s, e in split_steps(text)]
    # Markers win over blank lines; text before the first marker is not a step; closing tags are cut.
    assert steps == ["<step 1> a = 2", "<step 2>b = 3\n\nstill step 2", "<step 3>so 5"]
    assert (
        number_steps(text, split_steps(text))
        == "Step 1: a = 2\n\nStep 2: b = 3\n\nstill step 2\n\nStep 3: so 5"
    )


def test_split_on_step_lines():
    text = "We add.\nStep 1: a = 2\nStep 2. b = 3\n  step 3: so 5"
    spans = split_steps(text)
    assert [text[s:e] for s, e in spans] == ["Step 1: a = 2", "Step 2. b = 3", "step 3: so 5"]
    assert number_steps(text, spans) == "Step 1: a = 2\n\nStep 2: b = 3\n\nStep 3: so 5"
    assert len(split_steps("Step one is to add.\n\nThen stop.")) == 2  # "Step one" is no marker


@pytest.mark.parametrize(
    ("critique", "expected"),
    [
        ("Step 2 is off.\nWrong steps: 2, 3", {1, 2}),
        ("Wrong steps: [1]", {0}),
        ("Wrong steps: 1 and 3", {0, 2}),
        ("Wrong step: **none**", set()),
        ("Wrong steps: 2\nOn reflection, Wrong steps: none", {1}),  # the first line counts
        ("Wrong steps: 4", None),  # only 3 steps
        ("Wrong steps: 0", None),  # steps are numbered from 1
        ("Everything is fine.", None),
    ],
)
def test_parse_wrong_steps(critique, expected):
    assert parse_wrong_steps(critique, num_steps=3) == expected


def test_token_spans_by_hand():
    # "ab\n\ncd": steps at chars [0, 2) and [4, 6). Tokens: "a" [0,1), "b\n" [1,3), "\nc" [3,5), "d" [5,6).
    offsets = [(0, 1), (1, 3), (3, 5), (5, 6)]
    # Step 0 touches tokens 0-1; step 1 touches tokens 2-3 (token 2 straddles whitespace and "c").
    assert token_spans([(0, 2), (4, 6)], offsets) == [(0, 2), (2, 4)]
    # A token straddling a real boundary belongs to the first step it overlaps: "b\nc" at [1, 4) overlaps
    # [0, 2) and [3, 5) and goes to step 0, so step 1 keeps only token 2. Spans never overlap.
    assert token_spans([(0, 2), (3, 5)], [(0, 1), (1, 4), (4, 5)]) == [(0, 2), (2, 3)]
    # A zero-width token (an empty special token at char 4) counts at its position; a step no token
    # touches gets (0, 0).
    assert token_spans([(0, 2), (4, 6), (9, 10)], [(0, 2), (4, 4), (4, 6)]) == [(0, 1), (1, 3), (0, 0)]
