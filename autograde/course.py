"""Where the course's notebooks are: `solutions/` (the reference) and `exercises/` (the release).

In the course's own folder (a clone, or an editable install) they sit beside the `autograde`
package. With the package installed elsewhere, they are found in the current folder or one of
its parents, or where $AUTOGRADE_COURSE says. A class's copy of the course may hold
`exercises/` alone: the learners' checks then use the expected values released with them. An
installed course (`pip install .`) holds those values too, as the package `autograde.released`,
so that a notebook opened anywhere can be checked.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

VARIABLE = "AUTOGRADE_COURSE"


class CourseNotFound(FileNotFoundError):
    pass


def _is_course(folder: Path) -> bool:
    """The instructor's copy (solutions/ and exercises/), or a class's (exercises/ with their expected values)."""
    exercises = folder / "exercises"
    return exercises.is_dir() and ((folder / "solutions").is_dir() or any(exercises.glob("*/*.expected.zip")))


def root() -> Path:
    given = os.environ.get(VARIABLE)
    if given:
        if not _is_course(Path(given)):
            raise CourseNotFound(f"${VARIABLE} is {given}, which holds no exercises/ folder")
        return Path(given).resolve()
    here = Path.cwd()
    for folder in (Path(__file__).resolve().parent.parent, here, *here.parents):
        if _is_course(folder):
            return folder
    raise CourseNotFound("the course's exercises/ folder was not found: run this from the "
                         f"course's folder (or one inside it), or set {VARIABLE} to it")


def has_solutions() -> bool:
    try:
        return (root() / "solutions").is_dir()
    except CourseNotFound:
        return False


def solutions() -> Path:
    folder = root() / "solutions"
    if not folder.is_dir():
        raise CourseNotFound(f"{root()} holds the exercises without their solutions (a class's copy of the "
                             "course): grading and releasing need the instructor's copy, with solutions/")
    return folder


def exercises() -> Path:
    """The course's exercises/; without a course here, the expected values installed with the package."""
    try:
        return root() / "exercises"
    except CourseNotFound as not_found:
        installed = _installed_release()
        if installed is None:
            raise CourseNotFound(
                f"{not_found}; the installed package holds no expected values either. Open the notebook "
                "inside the course's folder, or install the course from its folder with `pip install .`") from None
        return installed


def _installed_release() -> Path | None:
    """`autograde/released/`, the exercises' expected values as a wheel installs them (a namespace package)."""
    spec = importlib.util.find_spec("autograde.released")
    folders = list(spec.submodule_search_locations or []) if spec else []
    return next((Path(folder) for folder in folders if any(Path(folder).glob("*/*.expected.zip"))), None)
