"""Misconception feedback: a failing visible test names the known mistake the learner's output equals."""

from __future__ import annotations

import contextlib
import io

import pytest

from autograde import misconceptions, solutions
from autograde.frontends.check import check
from autograde.registry import EXERCISES, ORDER
from tests.fixtures.implementations import MHA_WRONG, SDPA_WRONG
from tests.test_exercise_flash import WRONG as FLASH_WRONG
from tests.test_exercise_gqa_kv_cache import WRONG as GQA_KV_WRONG
from tests.test_exercise_rope_mla import MLA_WRONG, ROPE_WRONG
from tests.test_exercise_split_kv_paged_kv import PAGED_WRONG, SPLIT_WRONG
from tests.test_exercise_window import WRONG as WINDOW_WRONG

pytestmark = pytest.mark.timeout(300)

DIAGNOSED = ORDER  # every exercise names at least three misconceptions
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
    names = solutions.namespace.__wrapped__(EXERCISES[exercise_id])
    for name, wrong in overrides.items():
        names[name] = wrong(names[name])
    return names


@pytest.mark.parametrize("exercise_id", DIAGNOSED)
def test_each_diagnosed_exercise_has_at_least_three(exercise_id: str):
    assert len({m.name for m in misconceptions.of(exercise_id)}) >= 3


def tiered(exercise_id: str, *values) -> pytest.param:
    """sdpa's in the fast tier; the others' (a second or more each) in the slow one."""
    return pytest.param(*values, marks=() if exercise_id == "sdpa" else pytest.mark.slow)


@pytest.mark.parametrize("misconception", [tiered(m.exercise, m) for m in misconceptions.MISCONCEPTIONS],
                         ids=lambda m: f"{m.exercise}-{m.name}")
def test_each_misconception_is_named_for_its_own_wrong_answer_and_no_other(misconception):
    found = causes(checked(misconception.exercise, solution_with(misconception.exercise, misconception.overrides)))
    assert found == {misconception.says}


@pytest.mark.parametrize("exercise_id", [tiered(exercise_id, exercise_id) for exercise_id in DIAGNOSED])
def test_the_solution_is_never_diagnosed(exercise_id: str):
    output = checked(exercise_id, solution_with(exercise_id, {}))
    assert "FAIL" not in output and CAUSE not in output


# Wrong answers written independently of the misconceptions (the course's fixtures): the same causes.
NAMED = [("sdpa", SDPA_WRONG, "no-scaling", "not-scaled"),
         ("sdpa", SDPA_WRONG, "softmax-over-queries", "softmax-over-queries"),
         ("sdpa", SDPA_WRONG, "inverted-mask", "mask-inverted"),
         ("sdpa", SDPA_WRONG, "top-left-causal-mask", "top-left-causal-mask"),
         ("mha", MHA_WRONG, "split-heads-without-transpose", "split-without-transpose"),
         ("mha", MHA_WRONG, "query-and-key-swapped-when-loading", "query-and-key-swapped"),
         ("gqa", GQA_KV_WRONG, "repeat-instead-of-repeat-interleave", "kv-tiled"),
         ("kv_cache", GQA_KV_WRONG, "attends-to-the-new-tokens-only", "new-tokens-only"),
         ("kv_cache", GQA_KV_WRONG, "projections-without-biases", "biases-dropped"),
         ("rope", ROPE_WRONG, "pairs-of-the-other-layout", "other-layout"),
         ("rope", ROPE_WRONG, "positions-not-offset-by-the-cache", "positions-from-zero"),
         ("rope", ROPE_WRONG, "decoding-ignores-rope-base", "default-base"),
         ("mla", MLA_WRONG, "scale-without-rope-dim", "scaled-without-rope-dim"),
         ("flash_forward", FLASH_WRONG, "top-left-causal-mask", "top-left-causal"),
         ("split_kv", SPLIT_WRONG, "query-head-i-reads-kv-head-i-mod-h-kv", "kv-heads-tiled"),
         ("paged_kv", PAGED_WRONG, "pages-in-the-order-of-their-numbers", "pages-sorted"),
         ("paged_kv", PAGED_WRONG, "attends-the-whole-last-page", "whole-last-page"),
         ("paged_kv", PAGED_WRONG, "query-head-i-reads-kv-head-i-mod-h-kv", "kv-heads-tiled"),
         ("paged_kv", PAGED_WRONG, "writes-at-the-last-cached-position", "at-last-cached-position"),
         ("window", WINDOW_WRONG, "window-off-by-one", "window-off-by-one"),
         ("window", WINDOW_WRONG, "top-left-alignment", "top-left-alignment"),
         ("window", WINDOW_WRONG, "sink-logit-in-the-numerator", "sink-in-the-numerator")]


@pytest.mark.parametrize("exercise_id, variants, variant, misconception", [tiered(n[0], *n) for n in NAMED],
                         ids=[f"{n[0]}-{n[2]}" for n in NAMED])
def test_a_wrong_answer_from_the_fixtures_is_named(exercise_id, variants, variant, misconception):
    [wrong] = [v for v in variants if v.name == variant and v.exercise == exercise_id]
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
