"""The release's nbgrader cells in a submission: each kind of tampering found, in one precise sentence."""

from __future__ import annotations

import copy
import csv
import dataclasses
from pathlib import Path

import nbformat
import pytest
from nbgrader import utils

from autograde import course
from autograde import registry as exercises
from autograde.compare import CaseResult
from autograde.grading import report
from autograde.grading.grade import Grade
from autograde.grading.session import catalogue
from autograde.submission import integrity, notebook
from autograde.submission.integrity import findings, released_notebook
from tests.fixtures.notebooks import learner_notebook, write

pytestmark = pytest.mark.timeout(60)

SDPA = exercises.get("sdpa")
TEST_CELL = "test-no-mask"  # points 1.5
LOCKED_CELL = "setup"
SOLUTION_CELL = "causal_mask"


def release() -> nbformat.NotebookNode:
    return released_notebook(SDPA)


def submission() -> nbformat.NotebookNode:
    """The sdpa release answered with the reference: a submission with nothing to report."""
    return learner_notebook("sdpa")


def cell(notebook: nbformat.NotebookNode, grade_id: str) -> nbformat.NotebookNode:
    return next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def found(submitted: nbformat.NotebookNode) -> list[str]:
    return findings(submitted, release())


@pytest.mark.parametrize("exercise_id", sorted(exercises.EXERCISES))
def test_the_release_and_an_answered_release_have_nothing_to_report(exercise_id: str):
    released = released_notebook(exercises.get(exercise_id))
    assert findings(copy.deepcopy(released), released) == []
    assert findings(learner_notebook(exercise_id), released) == []


def test_a_submission_read_from_disk_has_nothing_to_report(tmp_path: Path):
    path = write(submission(), tmp_path / "ada" / "attention" / "sdpa.ipynb")
    assert found(notebook.load(path)) == []


def test_released_notebook_is_read_once_from_exercises():
    assert released_notebook(SDPA) is released_notebook(SDPA)
    assert released_notebook(SDPA) == nbformat.read(course.exercises() / "attention" / "sdpa.ipynb", as_version=4)


def test_a_new_answer_and_new_cells_are_allowed():
    submitted = learner_notebook("sdpa", {SOLUTION_CELL: "def causal_mask(L, S=None, device=None):\n    pass\n"})
    submitted.cells.insert(3, nbformat.v4.new_code_cell("print('scratch')"))
    submitted.cells.append(nbformat.v4.new_markdown_cell("My notes"))
    assert found(submitted) == []


def test_an_edited_locked_cell():
    submitted = submission()
    setup = cell(submitted, LOCKED_CELL)
    setup.source = setup.source.replace("import sys", "import sys, os")
    assert found(submitted) == ["locked cell `setup` was changed (from line 2)"]


def test_a_test_cell_whose_test_is_replaced_by_pass():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    test.source = test.source.replace('run("sdpa", "no-mask", globals())', "pass")
    assert found(submitted) == ["test cell `test-no-mask` was changed (from line 4)"]


@pytest.mark.parametrize("edit, where", [
    (lambda source: source + "\nprint('extra')", "from line 5"),
    (lambda source: source.rsplit("\n", 1)[0], "from line 3"),  # its blank line 3 goes too
    (lambda source: source + "\n", "in its line endings"),
])
def test_lines_added_removed_or_ended_otherwise(edit, where: str):
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    test.source = edit(test.source)
    assert found(submitted) == [f"test cell `test-no-mask` was changed ({where})"]


def test_cells_without_ids_are_matched_by_grade_id_alone():
    submitted, released = submission(), copy.deepcopy(release())
    for each_notebook in (submitted, released):
        for each in each_notebook.cells:
            del each["id"]
    test = cell(submitted, TEST_CELL)
    del test.metadata.nbgrader["grade_id"]
    assert findings(submitted, released) == [
        "test cell `test-no-mask` was deleted",
        f"cell {submitted.cells.index(test) + 1} has nbgrader metadata without a grade_id"]


def test_a_deleted_test_cell():
    submitted = submission()
    submitted.cells.remove(cell(submitted, TEST_CELL))
    assert found(submitted) == ["test cell `test-no-mask` was deleted"]


def test_a_deleted_solution_cell():
    submitted = submission()
    submitted.cells.remove(cell(submitted, SOLUTION_CELL))
    assert found(submitted) == ["solution cell `causal_mask` was deleted"]


def test_raised_points():
    submitted = submission()
    cell(submitted, TEST_CELL).metadata.nbgrader.points = 100
    assert found(submitted) == ["test cell `test-no-mask` has its nbgrader metadata changed (points 1.5 -> 100)"]


def test_the_same_points_written_otherwise_are_no_change():
    submitted = submission()
    cell(submitted, "test-float32").metadata.nbgrader.points = 1  # 1.0 in the release
    assert found(submitted) == []


def test_a_flipped_grade_flag():
    submitted = submission()
    cell(submitted, TEST_CELL).metadata.nbgrader.grade = False
    assert found(submitted) == ["test cell `test-no-mask` was turned into a locked cell (grade true -> false)"]


def test_a_removed_locked_flag():
    submitted = submission()
    del cell(submitted, LOCKED_CELL).metadata.nbgrader["locked"]
    del cell(submitted, TEST_CELL).metadata.nbgrader["locked"]  # still locked, as a test cell
    assert found(submitted) == [
        "locked cell `setup` was turned into an ordinary cell (locked true -> absent)",
        "test cell `test-no-mask` has its nbgrader metadata changed (locked true -> absent)",
    ]


def test_a_solution_cell_turned_into_a_locked_cell():
    submitted = submission()
    meta = cell(submitted, SOLUTION_CELL).metadata.nbgrader
    meta.solution, meta.locked = False, True
    assert found(submitted) == [
        "solution cell `causal_mask` was turned into a locked cell (solution true -> false; locked false -> true)"]


def test_a_checksum_edited_to_match_an_edit():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    test.source = test.source.replace('run("sdpa", "no-mask", globals())', "pass")
    test.metadata.nbgrader.checksum = utils.compute_checksum(test)
    assert found(submitted) == [
        "test cell `test-no-mask` was changed (from line 4)",
        "test cell `test-no-mask` has its stored nbgrader checksum rewritten to match its changes",
    ]


def test_a_checksum_edited_to_match_raised_points():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    test.metadata.nbgrader.points = 15
    test.metadata.nbgrader.checksum = utils.compute_checksum(test)
    assert found(submitted) == [
        "test cell `test-no-mask` has its nbgrader metadata changed (points 1.5 -> 15)",
        "test cell `test-no-mask` has its stored nbgrader checksum rewritten to match its changes",
    ]


def test_an_edited_checksum_alone():
    submitted = submission()
    cell(submitted, SOLUTION_CELL).metadata.nbgrader.checksum = "0" * 32
    assert found(submitted) == [
        'solution cell `causal_mask` has its nbgrader metadata changed '
        '(checksum "ac5b36eedbe4904921c39770ba90e1f9" -> "00000000000000000000000000000000")']


def test_a_changed_cell_type():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    submitted.cells[submitted.cells.index(test)] = markdown = nbformat.v4.new_markdown_cell(
        test.source, metadata=test.metadata, id=test.id)  # as Jupyter's "change cell type" does
    assert found(submitted) == ["test cell `test-no-mask` was changed from a code cell to a markdown cell"]
    markdown.metadata.nbgrader.cell_type = "markdown"
    assert found(submitted) == [
        'test cell `test-no-mask` has its nbgrader metadata changed (cell_type "code" -> "markdown")',
        "test cell `test-no-mask` was changed from a code cell to a markdown cell",
    ]


@pytest.mark.parametrize("copies, count", [(1, "two"), (2, "three"), (4, "5")])
def test_a_duplicate_grade_id(copies: int, count: str):
    submitted = submission()
    copied = cell(submitted, SOLUTION_CELL)
    for _ in range(copies):  # copy and paste in Jupyter keeps the metadata
        submitted.cells.append(nbformat.v4.new_code_cell("x = 1", metadata=copy.deepcopy(copied.metadata)))
    assert found(submitted) == [f"{count} cells share grade_id `causal_mask`"]


def test_a_duplicated_test_cell_with_its_copy_edited():
    submitted = submission()
    test = copy.deepcopy(cell(submitted, TEST_CELL))
    test.source, test.id = "pass", "copied"
    submitted.cells.append(test)
    assert found(submitted) == ["test cell `test-no-mask` was changed (from line 1)",
                                "two cells share grade_id `test-no-mask`"]


def test_an_unknown_grade_id_on_a_new_cell():
    submitted = submission()
    extra = nbformat.v4.new_code_cell("assert True", metadata={"nbgrader": {
        "grade": True, "grade_id": "test-bonus", "locked": True, "points": 50, "solution": False}})
    submitted.cells.append(extra)
    assert found(submitted) == ["cell `test-bonus` has an nbgrader grade_id that the release does not have"]


def test_a_renamed_grade_id_is_found_by_the_cell_id():
    submitted = submission()
    cell(submitted, TEST_CELL).metadata.nbgrader.grade_id = "test-mine"
    assert found(submitted) == [
        'test cell `test-no-mask` has its nbgrader metadata changed (grade_id "test-no-mask" -> "test-mine")']


def test_a_renamed_grade_id_on_a_cell_with_a_new_id():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    test.metadata.nbgrader.grade_id, test.id = "test-mine", "mine"
    assert found(submitted) == ["test cell `test-no-mask` was deleted",
                                "cell `test-mine` has an nbgrader grade_id that the release does not have"]


def test_lost_nbgrader_metadata():
    submitted = submission()
    del cell(submitted, TEST_CELL).metadata["nbgrader"]
    assert found(submitted) == ["test cell `test-no-mask` has lost its nbgrader metadata"]


@pytest.mark.parametrize("value, described", [
    ([1, 2], "a list of 2 items"),
    ("grade", '"grade"'),
    (None, "null"),
    (7, "7"),
    (True, "true"),
])
def test_nbgrader_metadata_that_is_not_a_dict(value, described: str):
    submitted = submission()
    cell(submitted, TEST_CELL).metadata.nbgrader = value
    assert found(submitted) == [f"test cell `test-no-mask` has nbgrader metadata that is not a dict ({described})"]


def test_nbgrader_metadata_that_is_not_a_dict_on_a_cell_with_a_new_id():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    number = submitted.cells.index(test) + 1
    test.metadata.nbgrader, test.id = ["grade"], "mine"
    assert found(submitted) == ["test cell `test-no-mask` was deleted",
                                f"cell {number} has nbgrader metadata that is not a dict (a list of 1 item)"]


@pytest.mark.parametrize("points, described", [
    (10**5000, "an integer of about 5000 digits"),
    (1e308, "1e+308"),
    (float("inf"), "inf"),
    ("1.5", '"1.5"'),
    (True, "true"),
    ([1.5] * 10**6, "a list of 1000000 items"),
    ({"a": 1}, "a dict of 1 key"),
], ids=["huge-int", "huge-float", "infinity", "text", "bool", "long-list", "dict"])  # str() of the huge int fails
def test_huge_or_mistyped_points(points, described: str):
    submitted = submission()
    cell(submitted, TEST_CELL).metadata.nbgrader.points = points
    assert found(submitted) == [
        f"test cell `test-no-mask` has its nbgrader metadata changed (points 1.5 -> {described})"]


def test_a_huge_grade_id_and_flags_of_the_wrong_type():
    submitted = submission()
    meta = cell(submitted, LOCKED_CELL).metadata.nbgrader
    meta.grade_id, meta.locked = "`x`\n" * 10**6, "yes"
    shown = "'x'\\n" * 10  # forty characters, escaped, without backticks
    assert found(submitted) == ["locked cell `setup` has its nbgrader metadata changed "
                                f'(grade_id "setup" -> "{shown}…"; locked true -> "yes")']


def test_deeply_nested_metadata():
    nested: list = []
    for _ in range(50_000):
        nested = [nested]
    submitted = submission()
    meta = cell(submitted, TEST_CELL).metadata.nbgrader
    meta.grade, meta.points = nested, nested
    assert found(submitted) == ["test cell `test-no-mask` has its nbgrader metadata changed "
                                "(points 1.5 -> a list of 1 item; grade true -> a list of 1 item)"]


def test_malformed_cells_are_reported_not_raised():
    submitted = submission()
    test = cell(submitted, TEST_CELL)
    test.source = ["# Test no-mask", 42]
    submitted.cells[0].metadata = "locked"
    submitted.cells.append(12)
    submitted.cells.append({"cell_type": "code", "source": "", "metadata": {"nbgrader": {"grade_id": 3}}})
    submitted.cells.append({"cell_type": "code", "source": "", "metadata": {"nbgrader": {"solution": True}}})
    count = len(submitted.cells)
    assert found(submitted) == [
        "locked cell `setup` has metadata that is not a dict (\"locked\")",
        "test cell `test-no-mask` was changed (its source is a list of 2 items)",
        f"cell {count - 2} is 12, not a notebook cell",
        f"cell {count - 1} has an nbgrader grade_id that is not text (3)",
        f"cell {count} has nbgrader metadata without a grade_id",
    ]


@pytest.mark.parametrize("submitted", [None, [], {"cells": "none"}, {"nbformat": 4}])
def test_a_submission_without_cells(submitted):
    assert findings(submitted, release()) == [
        "the submission has no list of cells, so none of the release's nbgrader cells"]


def test_at_most_twenty_findings_then_a_count():
    submitted = submission()
    for number in range(50):
        submitted.cells.append(nbformat.v4.new_code_cell("", metadata={"nbgrader": {"grade_id": f"extra-{number}"}}))
    result = found(submitted)
    assert len(result) == integrity.MAX_FINDINGS + 1
    assert result[0] == "cell `extra-0` has an nbgrader grade_id that the release does not have"
    assert result[-1] == "and 30 more"


def test_a_finding_is_cut_to_a_few_lines():
    submitted = submission()
    meta = cell(submitted, TEST_CELL).metadata.nbgrader
    for field in integrity.FIELDS:
        meta[field] = "y" * 1000
    [finding] = found(submitted)
    assert finding.startswith("test cell `test-no-mask` was turned into a graded answer cell (points 1.5 -> \"yyy")
    assert len(finding) == integrity.MAX_CHARS and finding.endswith("…")


def test_an_unexpected_failure_is_reported_not_raised():
    assert findings(submission(), None) == ["the notebook's nbgrader cells could not be checked (AttributeError)"]


@pytest.mark.parametrize("exercise_id", sorted(exercises.EXERCISES))
def test_a_copy_of_the_solution_notebook_is_recognised_as_the_source_format(exercise_id: str):
    exercise = exercises.get(exercise_id)
    source = nbformat.read(course.solutions() / exercise.notebook, as_version=4)
    assert findings(source, released_notebook(exercise)) == [integrity.SOURCE_FORMAT]


def test_a_source_format_notebook_with_an_edited_locked_cell_is_still_found_out():
    source = nbformat.read(course.solutions() / SDPA.notebook, as_version=4)
    cell(source, LOCKED_CELL).source += "\nimport os"
    setup_lines = len(cell(release(), LOCKED_CELL).source.splitlines())
    cell(source, "test-gradients").source = "pass"  # a hidden test's cell, emptied
    cell(source, TEST_CELL).metadata.nbgrader.points = 5
    assert found(source) == [integrity.SOURCE_FORMAT,
                             f"locked cell `{LOCKED_CELL}` was changed (from line {setup_lines + 1})",
                             f"test cell `{TEST_CELL}` has its nbgrader metadata changed (points 1.5 -> 5)",
                             "test cell `test-gradients` was changed (from line 1)"]


def test_one_stripped_checksum_is_not_the_source_format():
    submitted = submission()
    del cell(submitted, LOCKED_CELL).metadata.nbgrader["checksum"]
    assert integrity.SOURCE_FORMAT not in found(submitted) and len(found(submitted)) == 1


def graded_with_findings() -> tuple[Grade, list[str]]:
    changed = found(nbformat.read(course.solutions() / SDPA.notebook, as_version=4)) + ["cell `x` was deleted"]
    notes = ("the notebook defines no `causal_mask`", *(integrity.CHANGED + finding for finding in changed))
    results = tuple(CaseResult(test.name, test.points, test.visible, test.about, "") for test in catalogue(SDPA))
    return Grade(SDPA, "graded", "", results, notes), changed


def test_the_learner_reads_one_sentence_and_the_instructor_every_finding(tmp_path: Path):
    grade, changed = graded_with_findings()
    feedback = report.feedback_markdown("ada", [grade], 12345)
    assert feedback.count(integrity.FOR_THE_LEARNER) == 1 and "the notebook defines no `causal_mask`" in feedback
    assert not any(finding in feedback for finding in changed) and "source format" not in feedback
    graded = [("ada", grade), ("bo", dataclasses.replace(grade, notes=()))]
    report.write_csv(tmp_path / "grades.csv", graded, 12345)
    flags = [row["changed_from_release"] for row in csv.DictReader((tmp_path / "grades.csv").open())]
    assert flags == ["yes", ""]
    report.write_integrity_csv(tmp_path / "integrity.csv", graded)
    rows = list(csv.DictReader((tmp_path / "integrity.csv").open()))
    assert [(row["student"], row["exercise"], row["finding"]) for row in rows] == [("ada", "sdpa", f) for f in changed]
    assert report.learner_notes(grade.notes) == ["the notebook defines no `causal_mask`", integrity.FOR_THE_LEARNER]
