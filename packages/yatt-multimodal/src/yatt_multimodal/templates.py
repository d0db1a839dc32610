"""Versioned judge prompt templates: an explicit registry keyed by (name, version).

A template is never edited once released: a changed prompt is a new version, so a run's judge config
(`JudgeSpec.template_name` / `template_version`) names the exact text its rewards came from.
`verify_yes_no` v1 follows WeChat-YATT's GenRM recipe: verify the solution step by step against the expected
answer, then end with a fixed verdict phrase. v2 is the same text with the instruction first and the solution
last, so the candidate answer sits right before the verdict: a small judge (the tiny preset's) compares it with
the expected answer over a few tokens instead of across the instruction, and learns to in a few hundred steps
(held-out verdict accuracy, yatt_apps.warmstart). `step_critique` v2 likewise puts the numbered steps last. `step_critique` v1 is CAPO's one-pass step critic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JudgeTemplate:
    """`user` is a `str.format` template over {question}, {response}, {reference_block} (and {steps},
    {num_steps} for step critiques); `parser` is the verdict parser its output is written for."""

    name: str
    version: int
    system: str
    user: str
    parser: str
    reference_block: str = "Expected answer: {reference}\n\n"

    def render(
        self, *, question: str, response: str, reference: str = "", **extra: object
    ) -> tuple[str, str]:
        """(system, user) texts. The reference block is left out when there is no reference."""
        block = self.reference_block.format(reference=reference) if reference else ""
        user = self.user.format(question=question, response=response, reference_block=block, **extra)
        return self.system, user


_VERIFY_SYSTEM = "You are a careful grader of solutions to problems."
_VERIFY_INSTRUCTION = (
    "Verify the solution step by step. If a reference answer is given, check the final answer "
    "against it. Finish with exactly one line: 'Verdict: Yes' if the solution is correct, "
    "'Verdict: No' otherwise."
)
_CRITIQUE_SYSTEM = "You are a careful checker of step-by-step solutions."
_CRITIQUE_INSTRUCTION = (
    "Check every step. Finish with exactly one line listing the numbers of the wrong "
    "steps, 'Wrong steps: 2, 5', or 'Wrong steps: none' if every step is correct."
)

TEMPLATES: dict[tuple[str, int], JudgeTemplate] = {
    ("verify_yes_no", 1): JudgeTemplate(
        name="verify_yes_no",
        version=1,
        system=_VERIFY_SYSTEM,
        user=(
            "Problem:\n{question}\n\n{reference_block}Solution to grade:\n{response}\n\n"
            + _VERIFY_INSTRUCTION
        ),
        parser="yes_no",
    ),
    ("verify_yes_no", 2): JudgeTemplate(
        name="verify_yes_no",
        version=2,
        system=_VERIFY_SYSTEM,
        user=_VERIFY_INSTRUCTION
        + "\n\nProblem:\n{question}\n\n{reference_block}Solution to grade:\n{response}",
        parser="yes_no",
    ),
    ("score", 1): JudgeTemplate(
        name="score",
        version=1,
        system=_VERIFY_SYSTEM,
        user=(
            "Problem:\n{question}\n\n{reference_block}Solution to grade:\n{response}\n\n"
            "Assess correctness and clarity step by step, then finish with exactly one line "
            "'Score: N' where N is a number from {low:g} to {high:g}."
        ),
        parser="score",
    ),
    ("json", 1): JudgeTemplate(
        name="json",
        version=1,
        system=_VERIFY_SYSTEM,
        user=(
            "Problem:\n{question}\n\n{reference_block}Solution to grade:\n{response}\n\n"
            'Verify the solution, then finish with one JSON object: {{"verdict": "yes"}} if it is correct, '
            '{{"verdict": "no"}} otherwise.'
        ),
        parser="json",
    ),
    ("step_critique", 1): JudgeTemplate(
        name="step_critique",
        version=1,
        system=_CRITIQUE_SYSTEM,
        user=(
            "Problem:\n{question}\n\n{reference_block}The solution, in {num_steps} numbered steps:\n"
            "{steps}\n\n" + _CRITIQUE_INSTRUCTION
        ),
        parser="wrong_steps",
    ),
    ("step_critique", 2): JudgeTemplate(
        name="step_critique",
        version=2,
        system=_CRITIQUE_SYSTEM,
        user=(
            _CRITIQUE_INSTRUCTION + "\n\nProblem:\n{question}\n\n{reference_block}"
            "The solution, in {num_steps} numbered steps:\n{steps}"
        ),
        parser="wrong_steps",
    ),
}


def get_template(name: str, version: int) -> JudgeTemplate:
    """The registered template, or a ValueError listing what exists."""
    try:
        return TEMPLATES[(name, version)]
    except KeyError:
        known = ", ".join(f"{n}@{v}" for n, v in sorted(TEMPLATES))
        raise ValueError(
            f"JudgeSpec.template_name/template_version {name}@{version} is not registered; known: {known}"
        ) from None
