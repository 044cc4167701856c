"""The exercises' tests are plain pytest: run on one notebook, selected with -k, reported as JUnit
XML; and adding an exercise is one test module, one solution notebook and a release."""

from __future__ import annotations

import csv
import json
import pdb
import shutil
import subprocess
import sys
import threading
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nbformat
import pytest
from _pytest.mark.structures import MARK_GEN

from autograde import registry
from autograde.grading import session as sessions
from autograde.grading.session import catalogue
from tests.fixtures.notebooks import ROOT, SEED

pytestmark = pytest.mark.timeout(600)


def test_the_tests_kept_for_a_process_leave_it_as_they_found_it(request):
    """The front ends' runs keep pytest's configuration of an exercise's tests for the process's
    life; what pytest changes for a whole process during a run must not stay changed with it, or a
    test suite that grades in its own process (this one) would find its own markers refused."""
    hooks, excepthook, set_trace = list(sys.meta_path), threading.excepthook, pdb.set_trace
    sessions._collections.pop("sdpa", None)
    kept = sessions._collected(registry.get("sdpa"))
    assert kept.items and kept.catalogue == catalogue(registry.get("sdpa"))
    assert sys.meta_path == hooks and threading.excepthook is excepthook and pdb.set_trace is set_trace
    assert MARK_GEN._config is request.config
    assert pytest.mark.slow.name == "slow"  # registered in this suite's configuration, not the exercises'


def pytest_on(notebook: Path, *options: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "autograde/tests/test_sdpa.py", "--notebook", str(notebook),
                           "-p", "no:cacheprovider", *options], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_one_notebook_with_pytest_junit_xml_and_k(tmp_path: Path):
    solution, release = ROOT / "solutions/attention/sdpa.ipynb", ROOT / "exercises/attention/sdpa.ipynb"
    passed = pytest_on(solution, "--seed", str(SEED), "--junitxml", str(tmp_path / "solution.xml"))
    assert passed.returncode == 0, passed.stdout[-2000:]
    assert "sdpa: 10 of 10 points from the tests run" in passed.stdout

    failed = pytest_on(release, "--seed", str(SEED), "--junitxml", str(tmp_path / "release.xml"))
    assert failed.returncode == 1
    cases = ElementTree.parse(tmp_path / "release.xml").getroot().iter("testcase")
    failures = {case.get("name"): case.find("failure").get("message") for case in cases}
    tests = catalogue(registry.get("sdpa"))
    assert len(failures) == len(tests)
    assert all("not implemented yet (it raises NotImplementedError)" in message for message in failures.values())

    visible = pytest_on(solution, "-k", "causal", "-q")  # no seed: the hidden tests are not run
    assert visible.returncode == 0
    causal = [test for test in tests if test.visible and "causal" in test.name]
    assert f"{len(causal)} passed, {len(tests) - len(causal)} deselected" in visible.stdout


TOY_DEFINITION = '''"""`toy`: the smallest exercise, to show how one is added."""

from autograde.adapters import adapter
from autograde.cases import Exercise

EXERCISE = Exercise(id="toy", assignment="toys", title="Doubling", required=("double",), not_allowed=())


@adapter
def doubled(learner, inputs):
    return {"double(x)": learner.double(inputs["x"])}
'''

TOY_TESTS = '''"""`toy`'s tests."""

import pytest
import torch

from autograde.cases import Inputs
from autograde.testing import assert_same


@pytest.mark.uses("double")
@pytest.mark.points(4)
def test_doubles(submission, reference, draw):
    """double(x) is 2 x"""
    inputs = Inputs({"x": draw.normal(3, 4)}, "a 3 x 4 tensor")
    assert_same(submission.doubled(inputs), reference.doubled(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.uses("double")
@pytest.mark.points(3)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_dtypes(submission, reference, draw, dtype):
    """the dtype of x is kept"""
    inputs = Inputs({"x": draw.normal(draw.integer(1, 5), dtype=dtype)})
    assert_same(submission.doubled(inputs), reference.doubled(inputs), inputs)
'''

TOY_SOLUTION = "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n"


def toy_notebook() -> nbformat.NotebookNode:
    setup = nbformat.v4.new_code_cell("import torch")
    setup.metadata["nbgrader"] = {"grade": False, "grade_id": "setup", "locked": True, "schema_version": 3,
                                  "solution": False, "task": False}
    answer = nbformat.v4.new_code_cell(TOY_SOLUTION)
    answer.metadata["nbgrader"] = {"grade": False, "grade_id": "double", "locked": False, "schema_version": 3,
                                   "solution": True, "task": False}
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Doubling"), setup, answer],
                                    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                             "language": "python"}})


def test_an_exercise_is_a_definition_a_test_module_a_solution_notebook_and_a_release(tmp_path: Path):
    course = tmp_path / "course"
    shutil.copytree(ROOT / "autograde", course / "autograde", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "solutions", course / "solutions")
    shutil.copytree(ROOT / "exercises", course / "exercises")
    (course / "autograde/exercises/toy.py").write_text(TOY_DEFINITION)
    (course / "autograde/tests/test_toy.py").write_text(TOY_TESTS)
    (course / "solutions/toys").mkdir()
    nbformat.write(toy_notebook(), course / "solutions/toys/toy.ipynb")

    release = subprocess.run([sys.executable, "-m", "autograde", "release"], cwd=course, capture_output=True,
                             text=True, timeout=300)
    assert release.returncode == 0, release.stderr[-3000:]
    cells = nbformat.read(course / "solutions/toys/toy.ipynb", as_version=4).cells
    tests = {c.metadata.nbgrader["grade_id"]: c.metadata.nbgrader["points"] for c in cells
             if c.get("metadata", {}).get("nbgrader", {}).get("grade")}
    assert tests == {"test-doubles": 4, "test-dtypes": 3}  # one cell per test function, written by the release
    released = nbformat.read(course / "exercises/toys/toy.ipynb", as_version=4)
    assert "return 2 * x" not in json.dumps(released)

    submitted = tmp_path / "submitted"
    for student, folder in (("ada", "solutions"), ("bert", "exercises")):
        (submitted / student / "toys").mkdir(parents=True)
        shutil.copy(course / folder / "toys/toy.ipynb", submitted / student / "toys/toy.ipynb")
    graded = subprocess.run([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(tmp_path / "out"),
                             "--seed", str(SEED), "--jobs", "1"], cwd=course, capture_output=True, text=True,
                            timeout=300)
    assert graded.returncode == 0, graded.stderr[-3000:]
    with (tmp_path / "out/grades.csv").open() as table:
        rows = {row["student"]: (row["score"], row["max_score"], row["status"]) for row in csv.DictReader(table)}
    assert rows == {"ada": ("7", "7", "graded"), "bert": ("0", "7", "graded")}
