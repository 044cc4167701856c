"""One run of an exercise's tests on one submission, and what it found.

`autograde/tests/conftest.py` (the tests' plugin) asks the run's `Session` for the exercise's
`submission` and records each test's result in it. The instructor's plain `pytest
autograde/tests/test_<id>.py --notebook ...` makes its sessions from its options (the conftest's
`_session`); the front ends make one each and call `Session.run`, which runs the tests pytest
configured and collected once in this process: the grader (`grade.py`), `check()` and nbgrader's
test cells (`frontends/check.py`, `frontends/nbgrader.py`, in the learner's kernel).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
from _pytest.config import _prepareconfig
from _pytest.mark.structures import MARK_GEN

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


# The run's sessions by exercise: a front end's one, or one per test module of a plain `pytest` run.
SESSIONS_KEY = pytest.StashKey[dict]()
# What the conftest found of each test when it was collected.
INFO_KEY = pytest.StashKey[TestInfo]()


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

    def runs(self, test: TestInfo) -> bool:
        """Whether a run of this session runs `test`: a collecting session lists every test; the
        hidden ones run with a seed, unless the session is for the visible ones only."""
        return self.open_submission is None or test.visible or (self.hidden_seed is not None
                                                                and not self.visible_only)

    def run(self, *selection: str) -> int:
        """Run the exercise's tests (`selection`: their functions' names, default all); pytest's exit code."""
        try:
            return _collected(self.exercise).run(self, selection)
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


class _CollectedTests:
    """An exercise's tests, configured and collected by pytest once per process, then run for one
    session at a time: each test through pytest's own protocol (fixtures set up, called, torn down,
    reported), as pytest's run loop does. A `pytest.main` per notebook would parse its options,
    register its plugins and collect the module again: 30 to 55 ms a notebook."""

    def __init__(self, exercise: Exercise):
        self.exercise = exercise
        collecting = Session(exercise, None)
        with _installed_plugins_left_out(), _process_state_kept():
            self.config = _prepareconfig([str(registry.test_file(exercise)), *_ARGUMENTS], plugins=[_Plugin()])
            self.config.stash[SESSIONS_KEY] = {exercise.id: collecting}
            self.config._do_configure()
            self.session = pytest.Session.from_config(self.config)
            self.config.hook.pytest_sessionstart(session=self.session)
            self.config.hook.pytest_collection(session=self.session)
        self.items = list(self.session.items)
        self.catalogue = tuple(collecting.catalogue)
        del self.config.stash[SESSIONS_KEY]

    def run(self, session: Session, selection: tuple[str, ...]) -> int:
        """Run `session`'s tests (all, or the functions named in `selection`) and record their results in it."""
        items = [item for item in self.items if session.runs(item.stash[INFO_KEY])
                 and (not selection or item.originalname in selection)]
        session.catalogue.extend(item.stash[INFO_KEY] for item in items)
        self.config.stash[SESSIONS_KEY] = {self.exercise.id: session}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                for item, following in zip(items, [*items[1:], None]):
                    item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
        except BaseException:
            # Cut short (an interruption, or a fault outside any test's protocol): fixtures may still
            # be set up, so the next run starts from a new configuration.
            _collections.pop(self.exercise.id, None)
            raise
        finally:
            del self.config.stash[SESSIONS_KEY]
        if not items:
            return int(pytest.ExitCode.NO_TESTS_COLLECTED)
        failed = any(result.problems for result in session.results.values())
        return int(pytest.ExitCode.TESTS_FAILED if failed else pytest.ExitCode.OK)


# Quiet runs: nobody reads pytest's output here, each test's result is recorded in its session.
# unraisableexception ends every session with five full garbage collections (about 1.5 s beside a
# learner's tensors); capture and logging set up and undo a capture around every test (together
# about 0.4 ms a test), and capture would hold the process's output for as long as it lives, as
# threadexception would `threading.excepthook` and debugging `pdb.set_trace`. The tests use none of
# the fixtures, reports and test kinds of the others, whose hooks each test calls (2 ms a notebook).
_ARGUMENTS = tuple(argument for plugin in (
    "cacheprovider", "terminal", "warnings", "faulthandler", "unraisableexception", "logging", "threadexception",
    "debugging", "capture", "unittest", "setuponly", "setupplan", "junitxml", "doctest", "pastebin", "legacypath",
    "tmpdir", "monkeypatch", "recwarn") for argument in ("-p", f"no:{plugin}"))


@contextlib.contextmanager
def _process_state_kept():
    """What configuring pytest changes for the whole process and puts back when its run ends: the
    import hook that rewrites asserts (the tests' modules are imported, and rewritten, by then) and
    the configuration that `pytest.mark` checks marks against (that of the run this process may be
    part of, an instructor's or a test suite's)."""
    import_hooks, mark_config = list(sys.meta_path), MARK_GEN._config
    try:
        yield
    finally:
        sys.meta_path[:] = import_hooks
        MARK_GEN._config = mark_config


_collections: dict[str, _CollectedTests] = {}


def _collected(exercise: Exercise) -> _CollectedTests:
    if exercise.id not in _collections:
        _collections[exercise.id] = _CollectedTests(exercise)
    return _collections[exercise.id]


class _Plugin:
    """pytest's own report of a failure is printed by nobody here: the conftest reads the exception."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config):
        # Its default style parses the test's source and prints its arguments, tensors included (up
        # to 40 ms a failing test); even Python's plain traceback finds every frame's code position
        # (3 ms). "no" keeps the exception's own line.
        config.option.tbstyle = "no"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        # Even in style "no", pytest filters the failure's traceback entry by entry against the
        # test's path (about 1 ms a failing test: 30 to 40 ms of a notebook whose every test fails).
        if call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
            return None  # pytest's own report
        return pytest.TestReport(item.nodeid, item.location, {}, "failed", call.excinfo.exconly(), call.when,
                                 [], call.duration, call.start, call.stop)


def catalogue(exercise: Exercise) -> tuple[TestInfo, ...]:
    """The exercise's tests (names, points, visibility, what each checks), from pytest's collection."""
    found = _collected(exercise).catalogue
    if not found:
        raise RuntimeError(f"no tests collected for {exercise.id} from {registry.test_file(exercise)}")
    return found


def max_score(exercise: Exercise) -> float:
    return total(test.points for test in catalogue(exercise))


def hidden_seed_from_environment() -> int | None:
    value = os.environ.get(SEED_VARIABLE)
    return int(value) if value else None


def default_notebook(exercise: Exercise) -> Path:
    return course.solutions() / exercise.notebook
