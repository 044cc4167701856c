"""The exercise notebooks: one source in solutions/, the release in exercises/ generated from it."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import nbformat
import numpy as np
import pytest

from autograde import registry as exercises
from autograde.frontends import release
from autograde.grading import batch, expected
from autograde.grading.session import catalogue
from autograde.observe import TensorValue
from tests.fixtures.notebooks import (
    MEASURED_HERE,
    ROOT,
    SEED,
    failed,
    grade_id,
    grade_in_process,
    is_solution_cell,
    learner_notebook,
)

pytestmark = pytest.mark.timeout(300)

EXERCISES = list(exercises.EXERCISES.values())
BOOK_PAGES = {"sdpa": {"attention-as-soft-lookup", "worked-example"},
              "mha": {"multi-head-attention", "pytorch-multiheadattention"}}  # at least these
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*)\n### END HIDDEN TESTS", re.S)
VOLATILE_METADATA = {"execution", "collapsed", "scrolled", "trusted"}


def source_notebook(exercise) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / exercise.notebook, as_version=4)


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_first_cell_sets_up_locally_and_on_colab(exercise):
    first = source_notebook(exercise).cells[0]
    assert first.cell_type == "code" and nbgrader_meta(first)["locked"]
    for needed in ('"google.colab" in sys.modules', 'COURSE_REPOSITORY = "https://github.com/mha-derived/mha-derived"',
                   '"git", "clone"', "sys.path.insert(0,", "torch.manual_seed(", "torch.cuda.is_available()"):
        assert needed in first.source


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_each_test_function_has_one_nbgrader_test_cell_with_its_points(exercise):
    """One cell per test function; a parametrised test's cases share it and its points add up."""
    tests = release.test_functions(exercise)
    test_cells = [c for c in source_notebook(exercise).cells if nbgrader_meta(c).get("grade")]
    assert [grade_id(c) for c in test_cells] == [f"test-{test.name}" for test in tests]
    for cell, test in zip(test_cells, tests):
        call = f'run("{exercise.id}", "{test.name}", globals())'
        assert nbgrader_meta(cell)["points"] == pytest.approx(test.points) and nbgrader_meta(cell)["locked"]
        hidden = HIDDEN.search(cell.source)
        assert (hidden is not None and hidden.group(1) == call) if not test.visible else call in cell.source


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_solution_cells_define_what_the_contract_asks(exercise):
    cells = [c for c in source_notebook(exercise).cells if is_solution_cell(c)]
    assert all("### BEGIN SOLUTION" in c.source and "### END SOLUTION" in c.source for c in cells)
    defined = {node.name for c in cells for node in ast.parse(c.source).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert set(exercise.required) <= defined


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_notebook_explains_links_the_book_and_checks(exercise):
    notebook = source_notebook(exercise)
    prose = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert "$$" in prose and "Hint" in prose
    linked = set(re.findall(r"https://mha-derived\.github\.io/mha-derived/book/([a-z0-9-]+)\.html", prose))
    assert linked >= BOOK_PAGES.get(exercise.id, set()) and linked
    assert all((ROOT / "book" / f"{page}.md").exists() for page in linked)
    assert any(f'check("{exercise.id}")' in c.source and grade_id(c).startswith("check")
               for c in notebook.cells if c.cell_type == "code")
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_solution_passes_every_test_and_the_release_none(exercise):
    solved, violations = grade_in_process(exercise.id, learner_notebook(exercise.id))
    assert failed(solved) - MEASURED_HERE == set() and not violations
    untouched, _ = grade_in_process(exercise.id, learner_notebook(exercise.id, blank=True))
    assert failed(untouched) == set(untouched)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_through_the_sandbox_every_solution_scores_full_marks_and_every_release_0(tmp_path: Path):
    """The instructor's grader on the whole course: every assignment's solutions and releases."""
    submitted = tmp_path / "submitted"
    assignments = sorted({exercise.assignment for exercise in EXERCISES})
    for assignment in assignments:
        shutil.copytree(ROOT / "solutions" / assignment, submitted / "ada" / assignment)
        shutil.copytree(ROOT / "exercises" / assignment, submitted / "bert" / assignment)
    rows = batch.grade_all(submitted, SEED, jobs=2, assignments=assignments, progress=False)
    scores = {(student, g.exercise.id): (g.status, g.score, g.max_score) for student, g in rows}
    assert scores == {(student, exercise.id): ("graded", score, 10)
                      for student, score in (("ada", 10), ("bert", 0)) for exercise in EXERCISES}


def test_the_mha_notebook_does_not_import_another_notebook():
    code = "\n".join(c.source for c in source_notebook(exercises.get("mha")).cells if c.cell_type == "code")
    assert not re.search(r"import sdpa|from sdpa|%run|import_ipynb|\.ipynb", code)


def comparable(notebook: nbformat.NotebookNode) -> list:
    return [(cell.cell_type, cell.source, {k: v for k, v in cell.metadata.items() if k not in VOLATILE_METADATA})
            for cell in notebook.cells]


def test_the_exercises_are_generated_from_the_solutions(tmp_path: Path):
    """Fails when exercises/ or the solutions' test cells are stale: run `python -m autograde release`
    (`make exercises`). The release runs on a copy: a test never repairs the tree it checks."""
    solutions = tmp_path / "solutions"
    shutil.copytree(ROOT / "solutions", solutions, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    released = tmp_path / "exercises"
    release.release(solutions=solutions, exercises=released)
    for path in sorted(solutions.rglob("*.ipynb")):
        synced = nbformat.read(path, as_version=4)
        in_tree = nbformat.read(ROOT / "solutions" / path.relative_to(solutions), as_version=4)
        assert comparable(synced) == comparable(in_tree), f"the test cells of solutions/{path.name} are stale"
    fresh = sorted(p.relative_to(released) for p in released.rglob("*.ipynb"))
    committed = sorted(p.relative_to(ROOT / "exercises") for p in (ROOT / "exercises").rglob("*.ipynb"))
    assert fresh == committed
    for path in fresh:
        generated = nbformat.read(released / path, as_version=4)
        on_disk = nbformat.read(ROOT / "exercises" / path, as_version=4)
        assert comparable(generated) == comparable(on_disk), f"exercises/{path} is stale"
    for exercise in exercises.EXERCISES.values():
        fresh_values, committed_values = (expected.read(expected.path(exercise, folder))
                                          for folder in (released, ROOT / "exercises"))
        assert fresh_values.keys() == committed_values.keys(), f"{exercise.id}'s released expected values are stale"
        for key, value in fresh_values.items():
            assert same_observation(value, committed_values[key]), f"{exercise.id}'s released expected values are stale"


def same_observation(a, b) -> bool:
    """Equal, floats within 1e-12 of the array's largest finite magnitude: another CPU may round the
    solution's float64 a last bit apart, and an entry left small by cancellation keeps the absolute
    error of its large terms (4.05524677e-05 in paged_kv's output, among entries up to 1.66, came
    out 4.9e-17 apart, 1.2e-12 relative, here and where it was released)."""
    if isinstance(a, TensorValue) and isinstance(b, TensorValue):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return False
        if a.array.dtype.kind != "f":
            return np.array_equal(a.array, b.array)
        finite = np.abs(b.array[np.isfinite(b.array)])
        scale = float(finite.max()) if finite.size else 0.0
        return np.allclose(a.array, b.array, rtol=1e-12, atol=1e-12 * scale + 1e-300, equal_nan=True)
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return all(same_observation(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return all(same_observation(a[key], b[key]) for key in a)
    if isinstance(a, float) and isinstance(b, float):
        return np.isclose(a, b, rtol=1e-12, atol=0, equal_nan=True)
    return a == b


def test_every_exercise_has_its_source_and_released_notebooks():
    for exercise in EXERCISES:
        assert (ROOT / "solutions" / exercise.notebook).is_file()
        assert (ROOT / "exercises" / exercise.notebook).is_file()


def test_the_release_hides_solutions_and_hidden_tests():
    for exercise in EXERCISES:
        released = nbformat.read(ROOT / "exercises" / exercise.notebook, as_version=4)
        text = "\n".join(c.source for c in released.cells)
        assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
        code = "\n".join(c.source for c in released.cells if c.cell_type == "code")
        regions = "\n".join(c.source for c in source_notebook(exercise).cells).count("### BEGIN SOLUTION")
        assert code.count("raise NotImplementedError()") == regions
        hidden = [case.name for case in catalogue(exercise) if not case.visible]
        assert not any(f'"{name}", globals())' in text for name in hidden)
