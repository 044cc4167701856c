"""`python -m autograde grade`, over a class and on one notebook, as an instructor runs it."""

from __future__ import annotations

import pytest

from autograde.frontends import cli
from tests.conftest import CLASS_EXPECTED
from tests.fixtures.notebooks import SEED

pytestmark = pytest.mark.timeout(600)


def test_grading_a_class_exits_0_and_writes_one_row_per_student_and_exercise(class_grades):
    assert class_grades.returncode == 0, class_grades.stderr
    assert list(class_grades.rows[0]) == ["student", "exercise", "score", "max_score", "status", "reason", "seed",
                                          "changed_from_release"]
    pairs = [(r["student"], r["exercise"]) for r in class_grades.rows]
    assert sorted(pairs) == sorted((s, e) for s in CLASS_EXPECTED for e in ("sdpa", "mha"))
    assert {r["max_score"] for r in class_grades.rows} == {"10"}
    assert {r["seed"] for r in class_grades.rows} == {str(SEED)}
    assert f"seed {SEED}" in class_grades.stdout


@pytest.mark.parametrize("student", sorted(CLASS_EXPECTED))
def test_each_student_gets_the_expected_score_and_status(class_grades, student):
    for exercise, (score, status) in CLASS_EXPECTED[student].items():
        row = class_grades.row(student, exercise)
        assert (float(row["score"]), row["status"]) == (score, status), row


def test_reasons_say_what_went_wrong(class_grades):
    reason = {(r["student"], r["exercise"]): r["reason"] for r in class_grades.rows}
    assert reason["ada", "sdpa"] == ""
    assert "failed: causal-mask-rectangular, causal-mask-random" in reason["cleo", "sdpa"]
    assert "not valid JSON" in reason["dan", "sdpa"]
    assert "no attention/mha.ipynb was submitted" in reason["dan", "mha"]
    assert "empty (0 bytes)" in reason["eve", "sdpa"]
    assert "uses torch.nn.functional.multi_head_attention_forward" in reason["eve", "mha"]


def test_feedback_details_visible_tests_and_names_hidden_ones_only(class_grades):
    feedback = (class_grades.out / "feedback" / "cleo.md").read_text()
    assert "## sdpa: 8.5 / 10" in feedback
    assert "| causal-mask-rectangular | 0 / 1 | failed |" in feedback
    assert "`causal_mask(3, 6)`: 9 of 18 entries differ, first at index (0, 1): expected True, got False" in feedback
    assert "| causal-mask-random (hidden) | 0 / 0.5 | failed |" in feedback
    assert "causal_mask(L, S) is bottom-right aligned" in feedback
    hidden_details = [line for line in feedback.splitlines() if "causal-mask-random" in line]
    assert hidden_details == ["| causal-mask-random (hidden) | 0 / 0.5 | failed |"]
    feedback = sorted(p.name for p in (class_grades.out / "feedback").iterdir())
    assert feedback == [f"{s}.md" for s in sorted(CLASS_EXPECTED)]


def test_one_notebook_gets_a_report_on_the_terminal(class_grades, capsys):
    notebook = class_grades.submitted / "cleo" / "attention" / "sdpa.ipynb"
    assert cli.main(["grade", str(notebook), "--seed", str(SEED)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sdpa (attention/sdpa.ipynb, Scaled dot-product attention): 8.5 / 10 points, status graded")
    assert "FAIL  causal-mask-random (hidden)" in out


def test_a_notebook_named_after_no_exercise_is_refused(tmp_path, capsys):
    notebook = tmp_path / "homework.ipynb"
    notebook.write_text("{}")
    assert cli.main(["grade", str(notebook)]) == 2
    assert "no exercise 'homework'" in capsys.readouterr().err
