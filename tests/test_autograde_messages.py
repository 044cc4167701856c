"""What a learner reads when a test fails: messages that name the likely cause, in the course's words."""

from __future__ import annotations

import numpy as np
import torch

from autograde import registry
from autograde.cases import Inputs
from autograde.compare import FLOAT32_HINT, NOT_RUN, CaseResult, compare_floats, compare_tensor
from autograde.frontends.check import check
from autograde.grading.report import case_lines, check_text, counted
from autograde.observe import TensorValue


def tensor(array: np.ndarray) -> TensorValue:
    return TensorValue(tuple(array.shape), f"torch.{array.dtype}", "cpu", array)


def test_a_float64_result_computed_in_float32_is_named_and_printed_with_digits_that_differ():
    want = np.random.default_rng(0).standard_normal((3, 4))
    got = want.astype(np.float32).astype(np.float64)  # float64 on the outside, float32 inside
    [problem] = compare_floats("out", want, got, 1e-10)
    assert problem.endswith(FLOAT32_HINT), problem
    printed = problem.split("(expected ")[1].split(")")[0]
    expected_value, got_value = printed.split(", got ")
    assert expected_value != got_value  # not the same six digits twice

    problems = compare_tensor("out", tensor(want), tensor(want.astype(np.float32)), "torch.float64", "cpu")
    assert problems[0] == ("`out`: expected dtype torch.float64 (the dtype of the first tensor argument), "
                           "got torch.float32")
    assert problems[1].endswith(FLOAT32_HINT)


def test_a_wrong_value_beyond_float32_precision_gets_no_float32_hint():
    want = np.linspace(0, 1, 6)
    [problem] = compare_floats("out", want, want + 1e-3, 1e-10)
    assert FLOAT32_HINT not in problem and "(expected 0.2, got 0.201)" in problem
    [problem] = compare_floats("out", want, want + 1e-3, 1e-5)  # a float32 result: its own tolerance, no hint
    assert FLOAT32_HINT not in problem


def test_infinities_print_as_inf():
    [problem] = compare_floats("lse", np.array([0.5, np.inf]), np.array([0.5, 3.0]), 1e-10)
    assert problem == "`lse`: max abs error inf at index (1,) (expected inf, got 3); tolerance 1e-10"
    [problem] = compare_floats("lse", np.array([0.5, -np.inf]), np.array([0.5, np.inf]), 1e-10)
    assert "max abs error inf" in problem and "e+308" not in problem


def test_the_inputs_line_leaves_out_which_results_a_test_reads():
    inputs = Inputs({"out_a": torch.zeros(2, 3, dtype=torch.float64), "lse_a": torch.zeros(2), "tags": ["", "_neg"],
                     "causal": True}, "finite lses")
    assert inputs.describe() == "out_a (2, 3) float64, lse_a (2,) float32, causal=True; finite lses"


def test_one_point_is_singular():
    assert (counted(1), counted(1.5), counted(0), counted(10)) == ("1 point", "1.5 points", "0 points", "10 points")
    result = CaseResult("causal-mask", 1, True, "the mask", "L=3")
    assert check_text("sdpa", [result], [], 0).endswith('check("sdpa"): 1 of 1 point from the visible tests')


def test_a_test_that_could_not_run_is_not_called_failed():
    result = CaseResult("random-shapes", 2, False, "random shapes", "",
                        (f"{NOT_RUN}no expected value was released for this call of attend: hidden tests need the "
                         "course's solutions",))
    first, *details = case_lines(result, details=True)
    assert first.startswith("NOT RUN  random-shapes (hidden)") and "FAIL" not in first
    assert details[-1].strip().startswith("not run: no expected value was released")


RAISES = """
import torch

def causal_mask(L, S=None, device=None):
    raise ValueError("not written yet")

def scaled_dot_product_attention(q, k, v, mask=None):
    raise ValueError("not written yet")
"""


def test_the_inputs_line_has_one_format_and_no_name_of_the_tests_own(capsys):
    namespace: dict = {}
    exec(RAISES, namespace)
    check("sdpa", namespace=namespace)
    lines = [line.strip().removeprefix("inputs: ") for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith("inputs: ")]
    assert len(lines) == 6, lines
    # a call of the learner's function and a call through the test's adapter read alike
    assert lines[0] == ("q (2, 3, 4, 8) float64, k (2, 3, 6, 8) float64, v (2, 3, 6, 5) float64; "
                        "no mask, L != S, d_v != d_k")
    assert lines[1] == "q (2, 2, 5, 16) float32, k (2, 2, 7, 16) float32, v (2, 2, 7, 16) float32; no mask"
    adapters = registry.adapters(registry.get("sdpa"))
    assert not any(f"{name}(" in line for line in lines for name in adapters), lines


def test_a_problem_two_checks_of_one_test_found_is_shown_once():
    cause = "likely cause: your output equals attention scaled by 1/d instead of 1/√d"
    result = CaseResult("forward-ragged", 1, True, "out and lse", "q (1, 2) float64", ("`out`: max abs error 1", cause,
                                                                                      "`lse`: max abs error 2", cause))
    assert [line.strip() for line in case_lines(result, details=True)[2:]] == [
        "`out`: max abs error 1", cause, "`lse`: max abs error 2"]


def test_feedback_folds_a_parametrised_tests_cases_into_one_row_naming_the_failed_ones():
    from autograde.grading.grade import GRADED, Grade
    from autograde.grading.report import FOLDED_CASES_SHOWN, feedback_markdown

    cases = [CaseResult(f"forward-random[case {i}]", 0.25, False, "random sizes", "",
                        ("inputs: ...", f"`out`: max abs error {i}") if i % 2 else ()) for i in range(10)]
    visible = CaseResult("forward-ragged", 1.0, True, "ragged", "q (2, 3, 45, 16)", ())
    grade = Grade(registry.get("flash_forward"), GRADED, "", (visible, *cases))
    table = [line for line in feedback_markdown("ada", [grade], 1).splitlines() if line.startswith("| ")]
    assert table[1:] == ["| forward-ragged | 1 / 1 | passed |",
                         f"| forward-random (hidden) | 1.25 / 2.5 | 5 of 10 cases failed (case 1; case 3; case 5; "
                         f"{5 - FOLDED_CASES_SHOWN} more) |"]
    passing = Grade(registry.get("flash_forward"), GRADED, "", tuple(
        CaseResult(f"forward-random[case {i}]", 0.25, False, "random sizes", "", ()) for i in range(4)))
    assert "| forward-random (hidden) | 1 / 1 | passed (all 4 cases) |" in feedback_markdown("ada", [passing], 1)
