"""Generate the learner notebooks `exercises/` from `solutions/` with nbgrader itself.

nbgrader's `generate_assignment` runs in a temporary course folder (its `source/` a copy of
`solutions/`), and its `release/` notebooks replace those in `exercises/`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"


def assignments(solutions: Path) -> list[str]:
    return sorted(p.name for p in solutions.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def nbgrader_environment() -> dict[str, str]:
    """nbgrader runs `alembic` by name: put this interpreter's scripts folder first on PATH."""
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)])}


def release(solutions: Path = SOLUTIONS, exercises: Path = EXERCISES) -> list[Path]:
    """Regenerate `exercises` from every assignment of `solutions`; returns the notebooks written."""
    with tempfile.TemporaryDirectory(prefix="autograde-release-") as scratch:
        course = Path(scratch)
        for assignment in assignments(solutions):
            shutil.copytree(solutions / assignment, course / "source" / assignment,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
            subprocess.run(
                [sys.executable, "-m", "nbgrader", "generate_assignment", assignment, "--force", "--quiet",
                 f"--CourseDirectory.root={course}", f"--db=sqlite:///{course / 'gradebook.db'}"],
                cwd=course, check=True, env=nbgrader_environment(),
            )
        # Only once every assignment generated: replace what was there, stale assignments included.
        shutil.rmtree(exercises, ignore_errors=True)
        written = []
        for notebook in sorted((course / "release").glob("*/*.ipynb")):
            target = exercises / notebook.parent.name
            target.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy(notebook, target)))
    return written
