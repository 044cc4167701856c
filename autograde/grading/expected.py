"""The visible tests' expected values, released with the exercises: a learner's checks need no solutions.

`python -m autograde release` runs each exercise's visible tests on the solution and writes
what the reference returned for each of their calls to `exercises/<assignment>/<id>.expected.zip`
(`frontends.release.write_expected`): `index.json` (each call's fingerprint and its result,
encoded as the worker encodes a reply) and the arrays as `.npy` files (`sandbox.wire`). Where
`solutions/` is absent, as in the copy an instructor gives a class, the tests' `reference`
replays them (`Released`, here). Hidden tests were never recorded: without the solutions they
cannot run, and say so.
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path
from typing import Any

from autograde import course
from autograde.cases import Exercise
from autograde.compare import NOT_RUN
from autograde.grading.proxies import LearnerFailed, Proxy
from autograde.grading.reference import Reference, released_fingerprint
from autograde.observe import Failure
from autograde.sandbox import wire

INDEX = "index.json"


def path(exercise: Exercise, exercises: Path | None = None) -> Path:
    return (exercises or course.exercises()) / exercise.assignment / f"{exercise.id}.expected.zip"


def read(file: Path) -> dict[str, Any]:
    """The recorded results by fingerprint, each read as a reply from the worker is (`wire.decode_result`)."""
    with tempfile.TemporaryDirectory(prefix="autograde-expected-") as scratch, zipfile.ZipFile(file) as archive:
        folder = Path(scratch)
        for name in archive.namelist():
            if Path(name).name != name:
                raise wire.WireError(f"{file.name} holds {name!r}, outside its folder")
            (folder / name).write_bytes(archive.read(name))
        index = wire.read_json(folder / INDEX)
        return {key: wire.decode_result(value, folder) for key, value in index.items()}


class Released(Proxy):
    """The reference's results for the visible tests' calls, as released with the exercises."""

    def __init__(self, exercise: Exercise):
        super().__init__(exercise)
        file = path(exercise)
        if not file.is_file():
            raise course.CourseNotFound(
                f"neither the course's solutions nor {file.name} (the expected values of {exercise.id}'s visible "
                f"tests) are here: run `python -m autograde release` in the course, or get the exercises again")
        self._results = read(file)

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        key = released_fingerprint(name, args, kwargs)
        if key not in self._results:  # the test cannot run here: not run, rather than failed
            raise LearnerFailed(Failure("not run", "", f"{NOT_RUN}no expected value was released for this call of "
                                        f"{name}: hidden tests, and inputs other than the visible tests', need the "
                                        "course's solutions (the instructor's copy)"))
        return self._results[key]


def reference_for(exercise: Exercise) -> Proxy:
    """The solution where the course has it, else the expected values released with the exercises."""
    if course.has_solutions() and (course.solutions() / exercise.notebook).is_file():
        return Reference(exercise)
    return Released(exercise)
