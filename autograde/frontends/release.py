"""Generate the learner notebooks `exercises/` from `solutions/` with nbgrader itself.

First the solution notebooks' autograded test cells are written from the exercises' tests
(`sync_test_cells`): one cell per test function, worth its points, calling
`run("<id>", "<test>", globals())`, hidden tests between nbgrader's hidden-test markers. Then
nbgrader's `generate_assignment` runs in a temporary course folder (its `source/` a copy of
`solutions/`), and its `release/` notebooks replace those in `exercises/`. No gradebook is
kept: the release needs none, and instructors keep their own. Last, each exercise's visible
tests run on the solution, and what the reference returned is written beside the notebook
(`grading.expected`), for learners' checks in a copy of the course without `solutions/`.

The notebooks link to the book and to the course's repository (the set-up cell clones it on
Colab; the Colab badge opens the notebook from it): the open edition's by default, and for a
graded class its own (`release --book-url ... --repository ...`), since the open chapters print
every answer. The links are rewritten in the source copy, before nbgrader computes its checksums.
"""

from __future__ import annotations

import itertools
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autograde import course, registry, solutions
from autograde.cases import Exercise
from autograde.grading import expected
from autograde.grading.local import LocalSubmission, one_thread
from autograde.grading.reference import Reference
from autograde.grading.session import Session, TestInfo, catalogue
from autograde.sandbox import wire

if TYPE_CHECKING:  # imported where used, after the grader's `notebook.skip_iri_grammars`
    import nbformat

TEST_CELL = "test-"  # how the grade ids of the autograded test cells start
OPEN_BOOK = "https://mha-derived.github.io/mha-derived/"  # the open edition, as solutions/ links to it
OPEN_REPOSITORY = "https://github.com/mha-derived/mha-derived"
COLAB = "https://colab.research.google.com/github/"
GITHUB = re.compile(r"https://github\.com/([^/\s]+/[^/\s]+?)(?:\.git)?/?$")


class LinkError(ValueError):
    pass


def relinked(text: str, book_url: str = OPEN_BOOK, repository: str = OPEN_REPOSITORY) -> str:
    """`text` (a notebook's cells) with the open edition's links pointing at `book_url` and `repository`.

    The Colab badge opens a notebook from a GitHub repository: for a repository elsewhere, the
    badge's line is left out."""
    book_url, repository = book_url.rstrip("/") + "/", repository.rstrip("/")
    colab_of_open = COLAB + GITHUB.match(OPEN_REPOSITORY).group(1) + "/"
    on_github = GITHUB.match(repository)
    if on_github:
        text = text.replace(colab_of_open, COLAB + on_github.group(1) + "/")
    else:
        text = "\n".join(line for line in text.split("\n") if colab_of_open not in line)
    return text.replace(OPEN_BOOK, book_url).replace(OPEN_REPOSITORY, repository)


def check_link(url: str, what: str) -> str:
    if not re.fullmatch(r"https?://[^\s\"'`\\]+", url):
        raise LinkError(f"{what} must be an http(s) URL without spaces or quotes: {url!r}")
    return url


def _relink_notebook(path: Path, book_url: str, repository: str) -> None:
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    sources = [cell.source for cell in notebook.cells]
    for cell in notebook.cells:
        cell.source = relinked(cell.source, book_url, repository)
    if [cell.source for cell in notebook.cells] != sources:  # the open edition's release is left byte for byte
        nbformat.write(notebook, path)


def test_functions(exercise: Exercise) -> list[TestInfo]:
    """The exercise's tests by function: a parametrised test's cases together, their points summed."""
    functions: dict[str, TestInfo] = {}
    for test in catalogue(exercise):
        name = test.name.split("[")[0]
        known = functions.get(name)
        functions[name] = TestInfo(name, test.points + (known.points if known else 0), test.visible, test.about,
                                   test.uses)
    return list(functions.values())


def test_cell(exercise_id: str, test: TestInfo) -> nbformat.NotebookNode:
    points = f"{test.points:g} point{'' if test.points == 1 else 's'}"
    import nbformat

    call = f'run("{exercise_id}", "{test.name}", globals())'
    source = "\n".join([f"# {'Test' if test.visible else 'Hidden test'} {test.name} ({points}): {test.about}",
                        "from autograde.frontends.nbgrader import run", "",
                        call if test.visible else f"### BEGIN HIDDEN TESTS\n{call}\n### END HIDDEN TESTS"])
    cell = nbformat.v4.new_code_cell(source)
    cell.id = f"{TEST_CELL}{test.name}"
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": cell.id, "locked": True, "points": test.points,
                                 "schema_version": 3, "solution": False, "task": False}
    return cell


def sync_test_cells(path: Path, exercise: Exercise) -> bool:
    """Write the notebook's test cells from the exercise's tests, where the old ones were (else at
    the end); whether the notebook changed."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    grade_id = lambda cell: cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")  # noqa: E731
    old = [index for index, cell in enumerate(notebook.cells) if grade_id(cell).startswith(TEST_CELL)]
    kept = [cell for cell in notebook.cells if not grade_id(cell).startswith(TEST_CELL)]
    at = old[0] if old else len(kept)
    cells = kept[:at] + [test_cell(exercise.id, test) for test in test_functions(exercise)] + kept[at:]
    if [(c.source, c.metadata) for c in cells] == [(c.source, c.metadata) for c in notebook.cells]:
        return False
    notebook.cells = cells
    nbformat.write(notebook, path)
    return True


def assignments(solutions: Path) -> list[str]:
    return sorted(p.name for p in solutions.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def generate(course: Path, assignment: str) -> None:
    # Imported here: nbgrader takes half a second to import, which every `autograde grade` would pay.
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    config = Config()
    config.CourseDirectory.root = str(course)
    config.GenerateAssignment.no_database = True
    config.SaveCells.enabled = False
    result = NbGraderAPI(config=config).generate_assignment(assignment, force=True)
    if not result["success"]:
        raise RuntimeError(f"nbgrader could not generate {assignment}: {result['error']}\n{result['log']}")


def release(solutions: Path | None = None, exercises: Path | None = None, book_url: str = OPEN_BOOK,
            repository: str = OPEN_REPOSITORY) -> list[Path]:
    """Regenerate `exercises` from every assignment of `solutions` (by default the course's own),
    linking to `book_url` and `repository`; returns the files written."""
    check_link(book_url, "the book's URL")
    check_link(repository, "the repository's URL")
    solutions, exercises = solutions or course.solutions(), exercises or course.exercises()
    for exercise in registry.EXERCISES.values():
        if (solutions / exercise.notebook).exists():
            sync_test_cells(solutions / exercise.notebook, exercise)
    with tempfile.TemporaryDirectory(prefix="autograde-release-") as scratch:
        nbgrader_course = Path(scratch)
        for assignment in assignments(solutions):
            shutil.copytree(solutions / assignment, nbgrader_course / "source" / assignment,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
            for notebook in (nbgrader_course / "source" / assignment).glob("*.ipynb"):
                _relink_notebook(notebook, book_url, repository)
            generate(nbgrader_course, assignment)
        # Only once every assignment generated: replace what was there, stale assignments included.
        shutil.rmtree(exercises, ignore_errors=True)
        written = []
        for notebook in sorted((nbgrader_course / "release").glob("*/*.ipynb")):
            target = exercises / notebook.parent.name
            target.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy(notebook, target)))
    for exercise in registry.EXERCISES.values():
        if (solutions / exercise.notebook).exists():
            written.append(write_expected(exercise, exercises))
    return written


ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so that the same solutions give the same file


def record_expected(exercise: Exercise) -> dict[str, Any]:
    """What the reference returned for each call of the visible tests, by the call's fingerprint,
    with the solution as the submission (so that every test makes all its calls).

    On one thread: how a float64 matmul splits its sums depends on the threads it has, and the
    released values should not depend on how many cores the machine has (they changed in the last bit)."""
    reference = Reference(exercise, recording=True)
    session = Session(exercise, lambda: LocalSubmission(exercise, solutions.namespace(exercise)),
                      visible_only=True, own_reference=reference)
    with one_thread():
        session.run()
    failed = [result.name for result in session.results.values() if not result.passed]
    if failed:
        raise RuntimeError(f"the solution of {exercise.id} fails its visible tests {failed}: nothing released")
    return reference.recorded


def write_expected(exercise: Exercise, exercises: Path | None = None) -> Path:
    """Record the visible tests' expected values and write them beside the exercise's notebook."""
    target = expected.path(exercise, exercises)
    with tempfile.TemporaryDirectory(prefix="autograde-expected-") as scratch:
        folder, names = Path(scratch), (f"a{index}" for index in itertools.count())
        recorded = sorted(record_expected(exercise).items())
        index = {key: wire.encode_result(value, folder, names) for key, value in recorded}
        wire.write_json(folder / expected.INDEX, index)
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(target, "w") as archive:
            for file in sorted(folder.iterdir(), key=lambda p: p.name):
                archive.writestr(zipfile.ZipInfo(file.name, ZIP_TIME), file.read_bytes(), zipfile.ZIP_DEFLATED)
    return target
