"""One pytest run of an exercise's tests on one submission, and what it found.

`autograde/tests/conftest.py` (the tests' plugin) asks the run's `Session` for the exercise's
`submission` and records each test's result in it. Every front end makes a `Session` and runs
pytest with it: the instructor's `pytest autograde/tests/test_<id>.py --notebook ...`
(`Session.from_options`), the grader (`grade.py`), `check()` and nbgrader's test cells
(`frontends/check.py`, `frontends/nbgrader.py`, in the learner's kernel).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest

from autograde import course, registry
from autograde.cases import Exercise
from autograde.compare import CaseResult, total
from autograde.grading import expected
from autograde.grading.proxies import LearnerFailed, Proxy
from autograde.grading.sandboxed import SandboxedSubmission
from autograde.observe import Failure
from autograde.submission.forbidden import Violation

SEED_VARIABLE = "AUTOGRADE_SEED"


def report_name(nodeid: str) -> str:
    """`test_file.py::test_no_mask[3-D]` -> `no-mask[3-D]`: how reports name a test."""
    function = nodeid.split("::")[-1]
    base, _, params = function.partition("[")
    return base.removeprefix("test_").replace("_", "-") + (f"[{params}" if params else "")


@dataclass(frozen=True)
class TestInfo:
    name: str
    points: float
    visible: bool
    about: str
    uses: tuple[str, ...] = ()


class Blocked(Proxy):
    """A submission that cannot run (not allowed, unreadable): every call fails with the reason."""

    def __init__(self, exercise: Exercise, reason: str):
        super().__init__(exercise)
        self.reason = reason

    def call(self, name, args, kwargs):
        raise LearnerFailed(Failure("not run", "", f"not run: {self.reason}"))


@dataclass
class Session:
    """The submission to test, the hidden tests' seed, and the results as pytest reports them."""

    exercise: Exercise
    open_submission: Callable[[], Proxy] | None  # None: collect the tests without running them
    hidden_seed: int | None = None
    visible_only: bool = False
    results: dict[str, CaseResult] = field(default_factory=dict)
    catalogue: list[TestInfo] = field(default_factory=list)
    submission: Proxy | None = None
    own_reference: Proxy | None = None  # None: the process's reference for the exercise

    def open(self) -> Proxy:
        if self.submission is None:
            self.submission = self.open_submission()
        return self.submission

    def reference(self) -> Proxy:
        return self.own_reference or _reference(self.exercise)

    def close(self) -> None:
        if isinstance(self.submission, SandboxedSubmission):
            self.submission.close()

    @property
    def violations(self) -> list[Violation]:
        return list(getattr(self.submission, "violations", []))

    def run(self, *selection: str, quiet: bool = True) -> int:
        """Run the exercise's tests (`selection`: node ids' function names, default all) with pytest."""
        path = registry.test_file(self.exercise)
        targets = [f"{path}::{name}" for name in selection] or [str(path)]
        arguments = [*targets, "-p", "no:cacheprovider"]
        if quiet:
            # unraisableexception ends every session with five full garbage collections: about
            # 1.5 s a call beside a learner's tensors, for warnings nobody reads here.
            arguments += ["-p", "no:terminal", "-p", "no:warnings", "-p", "no:faulthandler",
                          "-p", "no:unraisableexception"]
        if self.open_submission is None:
            arguments.append("--collect-only")
        output = io.StringIO()
        try:
            with _installed_plugins_left_out(), \
                    contextlib.redirect_stdout(output) if quiet else contextlib.nullcontext():
                return pytest.main(arguments, plugins=[_Plugin(self, quiet)])
        finally:
            self.close()


def _installed_plugins_left_out():
    """pytest without the plugins other packages install (anyio, xdist, timeout...): the tests use none,
    and loading them costs every run a scan of the installed packages, and the first run in a process
    (a learner's first `check()`) seconds of rewriting their modules' asserts."""
    return mock.patch.dict(os.environ, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


_references: dict[str, Proxy] = {}


def _reference(exercise: Exercise) -> Proxy:
    """One per exercise and process: it keeps what the solution returned for the visible tests' calls,
    and for one submitter's hidden ones at a time (`Reference.drawn_from`)."""
    if exercise.id not in _references:
        _references[exercise.id] = expected.reference_for(exercise)
    return _references[exercise.id]


class _Plugin:
    """Registers the session where the tests' conftest finds it."""

    def __init__(self, session: Session, quiet: bool):
        self.session = session
        self.quiet = quiet

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config):
        config.stash[SESSIONS_KEY] = {self.session.exercise.id: self.session}
        if self.quiet:
            # pytest's own report of a failure is printed by nobody here (the conftest reads the
            # exception). Its default style parses the test's source and prints its arguments, tensors
            # included (up to 40 ms a failing test); even Python's plain traceback finds every frame's
            # code position (3 ms). "no" keeps the exception's own line.
            config.option.tbstyle = "no"


# The run's sessions by exercise: a front end's one, or one per test module of a plain `pytest` run.
SESSIONS_KEY = pytest.StashKey[dict]()


_catalogues: dict[str, tuple[TestInfo, ...]] = {}


def catalogue(exercise: Exercise) -> tuple[TestInfo, ...]:
    """The exercise's tests (names, points, visibility, what each checks), from pytest's collection."""
    if exercise.id not in _catalogues:
        session = Session(exercise, None)
        session.run()
        if not session.catalogue:
            raise RuntimeError(f"no tests collected for {exercise.id} from {registry.test_file(exercise)}")
        _catalogues[exercise.id] = tuple(session.catalogue)
    return _catalogues[exercise.id]


def max_score(exercise: Exercise) -> float:
    return total(test.points for test in catalogue(exercise))


def hidden_seed_from_environment() -> int | None:
    value = os.environ.get(SEED_VARIABLE)
    return int(value) if value else None


def default_notebook(exercise: Exercise) -> Path:
    return course.solutions() / exercise.notebook
