"""Rule rewards: math verification on both backends (cases worked by hand), boxed extraction, format, regex,
exact match, and the async runner's timeouts, errors, weights and failure policy."""

import asyncio
import threading

import pytest
from yatt_multimodal.math_answers import MAX_ANSWER_DIGITS, extract_boxed, oversized_answer, verify_math
from yatt_multimodal.rewards import CombinedReward, RewardStepFailed, RuleReward, resolve_failures
from yatt_multimodal.rule_workers import RuleWorkerPool
from yatt_multimodal.rules import build_rule
from yatt_multimodal.types import RewardRequest, RewardSpec

BACKENDS = ["math_verify", "sympy"]


@pytest.fixture(scope="module")
def pool():
    with RuleWorkerPool(num_workers=2) as shared:  # one supervisor for the module's built rules
        yield shared


# (response, reference): the same number or expression written differently. Worked by hand:
# 1/2 = 0.5 = \frac{1}{2}; \frac{6}{4} = 3/2 = 1.5; (x+1)^2 = x^2 + 2x + 1; \sqrt{8} = 2\sqrt{2};
# 1,000 (thousands separator) = 1000; \dfrac{\pi}{2} = \pi/2; "x = 5" answers 5.
EQUIVALENT = [
    ("The answer is \\boxed{0.5}.", "\\frac{1}{2}"),
    ("So we get \\boxed{\\frac{6}{4}}", "1.5"),
    ("\\boxed{(x+1)^2}", "x^2 + 2x + 1"),
    ("Simplify: \\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("In total \\boxed{1,000} apples", "1000"),
    ("\\boxed{\\dfrac{\\pi}{2}}", "\\pi/2"),
    ("Solving, \\boxed{x = 5}", "5"),
    ("2 + 3 = 5, so the answer is 5", "5"),
]
# Wrong: 0.51 != 1/2; (x+1)^2 != x^2 + 1 (missing 2x); 3 != 5.
WRONG = [
    ("\\boxed{0.51}", "\\frac{1}{2}"),
    ("\\boxed{x^2 + 1}", "(x+1)^2"),
    ("\\boxed{3}", "5"),
]
# Malformed: no answer at all, an unclosed box, garbage inside the box, injected Python.
MALFORMED = [
    ("I do not know.", "5"),
    ("\\boxed{5", "5"),
    ("\\boxed{)(*&}", "5"),
    ("\\boxed{__import__('os').system('true')}", "0"),
]


def test_extract_boxed():
    assert extract_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"  # the last one
    assert extract_boxed("\\fbox{ 7 }") == "7"
    assert extract_boxed("\\boxed{{a}{b}}") == "{a}{b}"  # nested braces balanced
    assert extract_boxed("\\boxed{5") is None
    assert extract_boxed("no box") is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("response", "reference"), EQUIVALENT)
def test_equivalent_forms_accepted(backend, response, reference):
    assert verify_math(response, reference, backend=backend) is True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("response", "reference"), WRONG + MALFORMED)
def test_wrong_and_malformed_rejected(backend, response, reference):
    assert verify_math(response, reference, backend=backend) is False


# Answers a policy under RL wrote in the tiny GRPO job (the first three: seed 0, steps 85-217 of bench_e2e's
# async layout), each of which held math_verify until the rule's 10 s deadline; then a tower and factorials.
RUNAWAY = [
    "42^4441444444444",
    "44447472^4444444",
    "44444444^7474444",
    "\\boxed{9^{9^{9^{9}}}}",
    "99999999999!",
    "1600!",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_runaway_powers_and_factorials_are_wrong_without_being_evaluated(backend, monkeypatch):
    from yatt_multimodal import math_answers

    assert [oversized_answer(text) for text in RUNAWAY] == [True] * len(RUNAWAY)
    with monkeypatch.context() as patched:  # neither backend may see them (either would run for minutes)
        for name in ("_verify_with_math_verify", "_verify_with_sympy"):
            patched.setattr(
                math_answers, name, lambda response, reference: pytest.fail(f"{response} evaluated")
            )
        assert [verify_math(text, "12", backend=backend) for text in RUNAWAY] == [False] * len(RUNAWAY)
    # the bound is the number of digits (log10 a^b = b log10 a; log10 n! from lgamma), towers from the inside
    assert MAX_ANSWER_DIGITS == 4300
    assert not oversized_answer("10^{4299}") and oversized_answer("10^{4301}")  # 4300 and 4302 digits
    assert not oversized_answer("1500!") and oversized_answer("1600!")  # 4115 and 4465 digits
    assert oversized_answer("2^{2^{14}}") and not oversized_answer("2^{2^{13}}")  # 4933 and 2467 digits
    assert not oversized_answer("9^{9}") and oversized_answer("9^{9^{9}}")
    small = [
        "0.5^{99999999}",
        "1^{99999999999999}",
        "2^{0.5}",
        "x^{99999}",
        "10!",
        "2^10 + 3**2",
        "1600 != x",
    ]
    assert [oversized_answer(text) for text in small] == [False] * len(small)
    # only the answer counts: a large power in the reasoning before a boxed answer is not judged
    assert verify_math("since 2^{99999999} is huge, \\boxed{5}", "5", backend=backend) is True
    assert verify_math("\\boxed{3^{4}}", "81", backend=backend) is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_parses_are_cached_and_cached_verdicts_are_the_same(backend, monkeypatch):
    from yatt_multimodal import math_answers

    cache = {"math_verify": math_answers._parsed, "sympy": math_answers._to_sympy}[backend]
    pairs = EQUIVALENT + WRONG + MALFORMED
    cache.cache_clear()
    first = [verify_math(response, reference, backend=backend) for response, reference in pairs]
    assert first == [True] * len(EQUIVALENT) + [False] * (len(WRONG) + len(MALFORMED))
    # the same pairs again, every reference's parse now taken from the cache: the same verdicts
    hits = cache.cache_info().hits
    assert [verify_math(response, reference, backend=backend) for response, reference in pairs] == first
    assert cache.cache_info().hits - hits >= len({reference for _, reference in pairs})
    if backend == "sympy":
        return
    # math-verify: a group's reference is parsed once, and each short boxed answer once; an unboxed response
    # (the whole text) and a long boxed answer are parsed each time
    import math_verify

    parsed: list[str] = []
    real = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: parsed.append(text) or real(text, **kw))
    cache.cache_clear()
    group = ["\\boxed{\\dfrac{3}{7}}", "\\boxed{0.43}", "3/7", "\\boxed{\\dfrac{3}{7}}", "3/7"]
    assert [verify_math(response, "\\frac{3}{7}") for response in group] == [True, False, True, True, True]
    assert parsed == ["$\\frac{3}{7}$", "$\\dfrac{3}{7}$", "$0.43$", "3/7", "3/7"]
    long_answer = "+".join(["1"] * 150)  # 299 characters: past MAX_CACHED_ANSWER_CHARS
    assert len(long_answer) > math_answers.MAX_CACHED_ANSWER_CHARS
    parsed.clear()
    assert [verify_math(f"\\boxed{{{long_answer}}}", "150") for _ in range(2)] == [True, True]
    assert parsed == ["$150$", f"${long_answer}$", f"${long_answer}$"]


def _restore_sympy_parse_expr(monkeypatch):
    """Undo `share_sympy_namespace` when the test ends: every module that holds sympy's parse_expr gets it back."""
    import sys

    from sympy.parsing import sympy_parser

    for module in ("sympy.parsing.sympy_parser", "sympy.parsing", "math_verify.parser"):
        if module in sys.modules:
            monkeypatch.setattr(sys.modules[module], "parse_expr", sympy_parser.parse_expr)


def test_the_shared_namespace_is_the_one_sympy_builds_for_each_parse():
    from sympy.parsing import sympy_parser
    from yatt_multimodal.math_answers import sympy_namespace

    built: list[dict] = []

    def capture(tokens, local_dict, global_dict):  # a transformation sees the globals parse_expr made
        built.append(dict(global_dict))
        return tokens

    steps = (capture, *sympy_parser.standard_transformations)
    assert sympy_parser.parse_expr("2*x + 1", transformations=steps) is not None
    ours = sympy_namespace()
    assert len(ours) > 900 and built[0].keys() == ours.keys()
    assert all(built[0][name] is ours[name] for name in ours)  # the same objects, not equal copies


def test_a_shared_namespace_gives_the_same_parses_and_verdicts_without_building_it(monkeypatch):
    import math_verify.parser
    import sympy
    from sympy.parsing import sympy_parser
    from yatt_multimodal import math_answers
    from yatt_multimodal.rule_workers import _warm_up

    _restore_sympy_parse_expr(monkeypatch)
    pairs = EQUIVALENT + WRONG + MALFORMED + [("7 + 3", "10"), ("it is 25", "25"), ("(2^3)*5", "40")]
    texts = ["7 + 3", "25", "2**10 - 1", "max(3, 4)", "x**2 + 2*x + 1", "Rational(3, 7)", "1/2"]
    math_answers._parsed.cache_clear()
    before_verdicts = [verify_math(response, reference) for response, reference in pairs]
    before_parses = [sympy_parser.parse_expr(text, evaluate=False) for text in texts]
    builds = []
    real_exec = exec
    monkeypatch.setattr(sympy_parser, "exec", lambda *a: builds.append(a) or real_exec(*a), raising=False)
    sympy.Number("26")
    assert len(builds) == 1  # unshared: each parse builds the namespace (`from sympy import *`)
    builds.clear()
    _warm_up()  # what the rule pool's supervisor runs before it forks its workers
    shared = sympy_parser.parse_expr
    math_answers.share_sympy_namespace()  # idempotent: one wrapper, not a wrapper of it
    assert sympy_parser.parse_expr is shared and shared.shares_namespace
    assert math_verify.parser.parse_expr is shared and sympy.parsing.parse_expr is shared
    math_answers._parsed.cache_clear()
    assert [verify_math(response, reference) for response, reference in pairs] == before_verdicts
    assert before_verdicts[: len(EQUIVALENT)] == [True] * len(EQUIVALENT)
    assert [sympy_parser.parse_expr(text, evaluate=False) for text in texts] == before_parses
    assert sympy.sympify("max(2, 5)") == 5 and sympy.Number("25") == 25  # sympify of a string goes through it
    assert builds == []  # not one `from sympy import *`
    sympy_parser.parse_expr("x + 1", global_dict={"Symbol": sympy.Symbol, "Integer": sympy.Integer})
    assert builds == []  # a caller's own globals are used as given


def test_verify_math_bad_arguments():
    with pytest.raises(ValueError, match="reference is empty"):
        verify_math("\\boxed{1}", "  ")
    with pytest.raises(ValueError, match="backend must be auto, math_verify or sympy, got 'maple'"):
        verify_math("\\boxed{1}", "1", backend="maple")


def _req(response, reference="", rid="r"):
    return RewardRequest(request_id=rid, prompt="q", response=response, reference=reference)


def test_format_regex_and_exact_match(pool):
    def _score(spec, response, reference=""):
        return build_rule(spec, pool=pool).score_sync([_req(response, reference)]).rewards[0].score

    tags = RewardSpec(kind="tag_format")
    assert _score(tags, "<think>2+3</think>\n<answer>5</answer>") == 1.0
    assert _score(tags, "<answer>5</answer><think>2+3</think>") == 0.0  # wrong order
    assert _score(tags, "<think>a</think><answer>5</answer> trailing") == 0.0
    assert _score(RewardSpec(kind="boxed_format"), "so \\boxed{5}") == 1.0
    assert _score(RewardSpec(kind="boxed_format"), "\\boxed{5} or \\boxed{6}") == 0.0  # two answers
    assert _score(RewardSpec(kind="regex", options={"pattern": r"\d+$"}), "answer 42") == 1.0
    assert _score(RewardSpec(kind="regex", options={"pattern": r"\d+", "mode": "fullmatch"}), "a 42") == 0.0
    exact = RewardSpec(kind="exact_match")
    assert _score(exact, "The answer is \\boxed{Paris.}", "paris") == 1.0  # boxed, case and period ignored
    assert _score(exact, "Lyon", "Paris") == 0.0
    assert _score(RewardSpec(kind="exact_match", options={"normalise": "false"}), "paris", "Paris") == 0.0


def test_build_rule_rejects_bad_specs():
    with pytest.raises(ValueError, match=r"RewardSpec\.kind 'bleu' is not a rule"):
        build_rule(RewardSpec(kind="bleu"))
    with pytest.raises(ValueError, match=r"RewardSpec\.options for 'regex'"):
        build_rule(RewardSpec(kind="regex", options={"pattern": "(", "mode": "search"}))
    with pytest.raises(ValueError, match=r"RewardSpec\.options for 'exact_match'.*'colour'"):
        build_rule(RewardSpec(kind="exact_match", options={"colour": "red"}))


def test_rule_errors_and_timeouts_fail_one_request():
    release = threading.Event()

    def rule(request):
        if request.response == "slow":
            release.wait(5)  # released below, so the abandoned thread ends
        if request.response == "bad":
            raise ValueError("row 7 has no reference")
        return 1.0

    reward = RuleReward("r", rule, timeout_s=0.2, max_concurrency=2)
    batch = asyncio.run(reward.score([_req("ok", rid="a"), _req("slow", rid="b"), _req("bad", rid="c")]))
    release.set()
    assert [(r.request_id, r.status, r.score) for r in batch.rewards] == [
        ("a", "ok", 1.0),
        ("b", "timeout", 0.0),
        ("c", "error", 0.0),
    ]
    assert batch.rewards[1].error == "r: no result within 0.2s"
    assert batch.rewards[2].error == "r: ValueError: row 7 has no reference"
    assert (batch.metrics.num_requests, batch.metrics.num_timeout, batch.metrics.num_error) == (3, 1, 1)


def test_combined_weights_and_failure_policy(pool):
    math = build_rule(RewardSpec(kind="math_verify", options={"backend": "sympy"}), pool=pool)
    fmt = build_rule(RewardSpec(kind="boxed_format", name="format"), pool=pool)
    broken = RuleReward("broken", lambda r: 1 / 0 if r.request_id == "c" else 0.5)
    combined = CombinedReward([(1.0, math), (0.1, fmt), (2.0, broken)])
    requests = [_req("\\boxed{4}", "4", "a"), _req("4", "4", "b"), _req("\\boxed{5}", "4", "c")]
    batch = asyncio.run(combined.score(requests))
    # a: 1.0 * 1 + 0.1 * 1 + 2.0 * 0.5 = 2.1; b: 1 + 0.1 * 0 + 1.0 = 2.0; c: broken fails -> error.
    assert [r.score for r in batch.rewards[:2]] == pytest.approx([2.1, 2.0])
    assert batch.rewards[0].components == {"math_verify": 1.0, "format": 1.0, "broken": 0.5}
    assert batch.rewards[2].status == "error"
    assert batch.rewards[2].error == "broken: ZeroDivisionError: division by zero"
    resolved = resolve_failures(batch)  # default: errors are dropped, counted
    assert (resolved.keep, resolved.metrics.num_dropped, resolved.metrics.num_error) == (
        [True, True, False],
        1,
        1,
    )
    with pytest.raises(RewardStepFailed, match=r"1 reward\(s\) failed with policy 'fail': c: error"):
        resolve_failures(batch, {"error": "fail"})
    # "zero" zeroes the failed term only: c = 1.0 * 0 (5 != 4) + 0.1 * 1 (boxed) + 2.0 * 0 (failed) = 0.1.
    zeroed = resolve_failures(batch, {"error": "zero"})
    assert (zeroed.scores[2], zeroed.keep[2]) == (pytest.approx(0.1), True)
    assert combined.failure_policy == {"parse_error": "zero", "timeout": "drop", "error": "drop"}


def test_rule_concurrency_limit():
    lock, active, peak = threading.Lock(), [0], [0]
    pair = threading.Barrier(2, timeout=10)  # two calls must overlap: a limit of 1 would break the barrier

    def rule(request):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        pair.wait()
        with lock:
            active[0] -= 1
        return 1.0

    batch = asyncio.run(
        RuleReward("r", rule, max_concurrency=2).score([_req("x", rid=str(i)) for i in range(6)])
    )
    assert [r.score for r in batch.rewards] == [1.0] * 6
    assert peak[0] == 2
