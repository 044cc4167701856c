"""How the tests of `sdpa` and `mha` tell a learner what is wrong, and what is not allowed.

What each wrong answer loses, and that right answers in other styles pass, is in
`test_exercise_sdpa_mha` (on every seed).

The answers run in this process through the same extraction, probes and comparison as the
grader's worker (they are this suite's own code); `test_autograde_cli` and
`test_autograde_sandbox` cover the separate process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autograde import registry as exercises
from autograde.grading import grade
from tests.fixtures.implementations import MHA_WRONG, SDPA_WRONG, variant_id
from tests.fixtures.notebooks import SEED, failed, grade_in_process, learner_notebook, write

pytestmark = pytest.mark.timeout(120)



@pytest.mark.parametrize("variant", [v for v in SDPA_WRONG + MHA_WRONG if v.not_allowed], ids=variant_id)
def test_a_not_allowed_function_is_found(variant):
    results, violations = grade_in_process(variant.exercise, learner_notebook(variant.exercise, variant.answers))
    assert violations


@pytest.mark.parametrize("variant", [v for v in SDPA_WRONG + MHA_WRONG
                                     if v.not_allowed and v.name != "hides-torch-sdpa-behind-getattr"],
                         ids=variant_id)
def test_a_not_allowed_function_in_the_source_scores_0_without_running(variant, tmp_path: Path):
    notebook = write(learner_notebook(variant.exercise, variant.answers), tmp_path / "answer.ipynb")
    result = grade.grade_notebook(notebook, exercises.get(variant.exercise), SEED)
    assert (result.status, result.score) == (grade.NOT_ALLOWED, 0)
    assert "which this exercise does not allow" in result.reason
    assert all(r.problems[0].startswith("not run: uses ") for r in result.results)


FEEDBACK = [
    ("nan-on-fully-masked-rows", "fully-masked-rows",
     "`out`: 24 NaNs where the expected values are not NaN, first at index (0, 0, 1, 0)"),
    ("always-float64", "float32",
     "`out`: expected dtype torch.float32 (the dtype of the first tensor argument), got torch.float64"),
    ("top-left-causal-mask", "causal-mask-rectangular",
     "`causal_mask(3, 6)`: 9 of 18 entries differ, first at index (0, 1): expected True, got False"),
    ("no-scaling", "no-mask", "`out`: max abs error"),
    ("split-heads-without-value-error", "split-heads-value-error",
     "`split_heads(x of width 10, 3) raises`: expected 'ValueError', got 'RuntimeError'"),
    ("bias-flag-ignored", "module-structure",
     "`MultiHeadAttention(16, 4, bias=False).q_proj`: expected 'nn.Linear(16, 16, bias=False)', "
     "got 'nn.Linear(16, 16, bias=True)'"),
    ("weights-averaged-over-heads", "self-attention", "`weights`: expected shape (2, 4, 5, 5), got (2, 5, 5)"),
]


@pytest.mark.parametrize("name, case, message", FEEDBACK, ids=[f[0] for f in FEEDBACK])
def test_feedback_says_precisely_what_is_wrong(name, case, message):
    variant = next(v for v in SDPA_WRONG + MHA_WRONG if v.name == name)
    results, _ = grade_in_process(variant.exercise, learner_notebook(variant.exercise, variant.answers))
    assert any(problem.startswith(message) for problem in results[case].problems), results[case].problems
    assert results[case].inputs  # the inputs are always described


def test_a_missing_function_is_named():
    results, _ = grade_in_process("sdpa", learner_notebook("sdpa", {"causal_mask": "# to do\n"}))
    assert failed(results) == {"causal-mask-square", "causal-mask-rectangular", "causal-mask-random"}
    assert results["causal-mask-square"].problems == (
        "the notebook defines no `causal_mask` (did the cell that defines it run?)",)


def test_an_untouched_release_says_not_implemented_where():
    results, _ = grade_in_process("sdpa", learner_notebook("sdpa", blank=True))
    assert failed(results) == set(results)
    assert results["no-mask"].problems[0].startswith(
        "not implemented yet (it raises NotImplementedError), at cell ")
    assert results["no-mask"].problems[0].endswith("line 14: `raise NotImplementedError()`")
