"""nbgrader itself: it validates the solution notebooks, and its autograde gives the grader's points."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from autograde import registry as exercises
from tests.conftest import NBGRADER_STUDENTS
from tests.fixtures.notebooks import ROOT, SEED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def nbgrader_environment() -> dict[str, str]:
    """nbgrader runs `alembic` by name: this interpreter's scripts folder goes first on PATH."""
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)])}


def nbgrader(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env or nbgrader_environment(),
                          capture_output=True, text=True, timeout=540)


@pytest.mark.parametrize("exercise_id", exercises.EXERCISES)
def test_nbgrader_validate_passes_on_the_solution_notebooks(exercise_id):
    """One notebook per call, each within its own time limit: the flash notebooks alone take minutes.
    A cell's time limit is the grader's (nbgrader's 30 s default is passed by flash_forward's first
    test cell on a 2-core machine that other work shares): what is checked is that the cells pass."""
    notebook = ROOT / "solutions" / exercises.get(exercise_id).notebook
    process = nbgrader("validate", "--Execute.timeout=300", str(notebook), cwd=ROOT)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.count("Success! Your notebook passes all the tests.") == 1, process.stdout


def test_nbgrader_autograde_gives_the_same_points_as_the_grader(class_grades, tmp_path: Path):
    course = tmp_path / "course"
    shutil.copytree(ROOT / "solutions" / "attention", course / "source" / "attention")
    for student in NBGRADER_STUDENTS:
        shutil.copytree(class_grades.submitted / student, course / "submitted" / student)
    database = f"sqlite:///{course / 'gradebook.db'}"
    # The kernels that nbgrader starts import `autograde` from here and draw the hidden inputs from this seed.
    env = {**nbgrader_environment(), "PYTHONPATH": str(ROOT), "AUTOGRADE_SEED": str(SEED)}
    common = [f"--CourseDirectory.root={course}", f"--db={database}"]
    generated = nbgrader("generate_assignment", "attention", "--force", *common, cwd=course, env=env)
    assert generated.returncode == 0, generated.stderr[-3000:]
    autograded = nbgrader("autograde", "attention", "--force", "--Execute.timeout=300", *common, cwd=course, env=env)
    assert autograded.returncode == 0, autograded.stderr[-3000:]

    with Gradebook(database) as gradebook:
        nbgrader_points = {
            (student, exercise_id): gradebook.find_submission_notebook(exercise_id, "attention", student).score
            for student in NBGRADER_STUDENTS for exercise_id in ("sdpa", "mha")
        }
    grader_points = {key: float(class_grades.row(*key)["score"]) for key in nbgrader_points}
    assert nbgrader_points == grader_points
    assert len(set(nbgrader_points.values())) == 3  # full marks, nothing, and something in between
