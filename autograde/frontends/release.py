"""Generate the learner notebooks `exercises/` from `solutions/` with nbgrader itself.

nbgrader's `generate_assignment` runs in a temporary course folder (its `source/` a copy of
`solutions/`), and its `release/` notebooks replace those in `exercises/`. No gradebook is
kept: the release needs none, and instructors keep their own.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from nbgrader.apps import NbGraderAPI
from traitlets.config import Config

from autograde import course


def assignments(solutions: Path) -> list[str]:
    return sorted(p.name for p in solutions.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def generate(course: Path, assignment: str) -> None:
    config = Config()
    config.CourseDirectory.root = str(course)
    config.GenerateAssignment.no_database = True
    config.SaveCells.enabled = False
    result = NbGraderAPI(config=config).generate_assignment(assignment, force=True)
    if not result["success"]:
        raise RuntimeError(f"nbgrader could not generate {assignment}: {result['error']}\n{result['log']}")


def release(solutions: Path | None = None, exercises: Path | None = None) -> list[Path]:
    """Regenerate `exercises` from every assignment of `solutions` (by default the course's own);
    returns the notebooks written."""
    solutions, exercises = solutions or course.solutions(), exercises or course.exercises()
    with tempfile.TemporaryDirectory(prefix="autograde-release-") as scratch:
        nbgrader_course = Path(scratch)
        for assignment in assignments(solutions):
            shutil.copytree(solutions / assignment, nbgrader_course / "source" / assignment,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
            generate(nbgrader_course, assignment)
        # Only once every assignment generated: replace what was there, stale assignments included.
        shutil.rmtree(exercises, ignore_errors=True)
        written = []
        for notebook in sorted((nbgrader_course / "release").glob("*/*.ipynb")):
            target = exercises / notebook.parent.name
            target.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy(notebook, target)))
    return written
