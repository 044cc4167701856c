"""Misconception feedback: a failing visible test names the known mistake the learner's output equals."""

from __future__ import annotations

import contextlib
import io

import pytest

from autograde import misconceptions
from autograde.frontends.check import check
from autograde.grading import reference
from autograde.registry import EXERCISES
from tests.fixtures.implementations import MHA_WRONG, SDPA_WRONG

pytestmark = pytest.mark.timeout(300)

DIAGNOSED = ("sdpa", "mha", "gqa")  # the exercises with misconceptions so far
CAUSE = "likely cause: your output equals "


def checked(exercise_id: str, namespace: dict) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        check(exercise_id, namespace=namespace)
    return printed.getvalue()


def causes(output: str) -> set[str]:
    return {line.strip().removeprefix(CAUSE) for line in output.splitlines() if line.strip().startswith(CAUSE)}


def solution_with(exercise_id: str, overrides: dict) -> dict:
    """A fresh run of the solution cells with some functions replaced, as a learner's notebook."""
    names = reference.namespace.__wrapped__(EXERCISES[exercise_id])
    for name, wrong in overrides.items():
        names[name] = wrong(names[name])
    return names


@pytest.mark.parametrize("exercise_id", DIAGNOSED)
def test_each_diagnosed_exercise_has_at_least_three(exercise_id: str):
    assert len({m.name for m in misconceptions.of(exercise_id)}) >= 3


@pytest.mark.parametrize("misconception", misconceptions.MISCONCEPTIONS, ids=lambda m: f"{m.exercise}-{m.name}")
def test_each_misconception_is_named_for_its_own_wrong_answer_and_no_other(misconception):
    found = causes(checked(misconception.exercise, solution_with(misconception.exercise, misconception.overrides)))
    assert found == {misconception.says}


@pytest.mark.parametrize("exercise_id", DIAGNOSED)
def test_the_solution_is_never_diagnosed(exercise_id: str):
    output = checked(exercise_id, solution_with(exercise_id, {}))
    assert "FAIL" not in output and CAUSE not in output


# Wrong answers written independently of the misconceptions (the course's fixtures): the same causes.
NAMED = [("sdpa", SDPA_WRONG, "no-scaling", "not-scaled"),
         ("sdpa", SDPA_WRONG, "softmax-over-queries", "softmax-over-queries"),
         ("sdpa", SDPA_WRONG, "inverted-mask", "mask-inverted"),
         ("sdpa", SDPA_WRONG, "top-left-causal-mask", "top-left-causal-mask"),
         ("mha", MHA_WRONG, "split-heads-without-transpose", "split-without-transpose"),
         ("mha", MHA_WRONG, "query-and-key-swapped-when-loading", "query-and-key-swapped")]


@pytest.mark.parametrize("exercise_id, variants, variant, misconception", NAMED, ids=[n[2] for n in NAMED])
def test_a_wrong_answer_from_the_fixtures_is_named(exercise_id, variants, variant, misconception):
    [wrong] = [v for v in variants if v.name == variant]
    names = solution_with(exercise_id, {})
    for source in wrong.answers.values():
        exec(source, names)
    [expected] = [m for m in misconceptions.of(exercise_id) if m.name == misconception]
    assert causes(checked(exercise_id, names)) == {expected.says}


def test_a_wrong_answer_no_misconception_explains_gets_none():
    [wrong] = [v for v in SDPA_WRONG if v.name == "returns-output-and-scores"]
    names = solution_with("sdpa", {})
    exec(wrong.answers["scaled_dot_product_attention"], names)
    output = checked("sdpa", names)
    assert "FAIL" in output and CAUSE not in output


def test_outside_a_test_nothing_is_diagnosed():
    assert misconceptions.diagnose(1, 2, lambda got, want: ["differs"]) is None
