"""The exercises' tests as a pytest plugin: markers, options and the fixtures every test uses.

Run the tests of one exercise on one notebook, as an instructor:

    pytest autograde/tests/test_sdpa.py --notebook submitted/ada/attention/sdpa.ipynb --seed 12345

Without `--notebook` they run on the course's solution; without `--seed` (or $AUTOGRADE_SEED)
the hidden tests are not run. `-k`, `-x`, `--junitxml` and the rest of pytest work as usual.
The learner's code runs in a sandboxed worker; this process only sends it calls and reads
back what they returned (`autograde/grading/proxies.py` and the modules beside it).

Markers:
    @pytest.mark.points(1.5)   the test's points (shared equally by its parametrised cases)
    @pytest.mark.hidden        inputs from the instructor's seed; feedback names the test only
    @pytest.mark.time_limit(60)  seconds for one call of the learner's code (default 20)
    @pytest.mark.uses("causal_mask")  the exercise's functions it tests: `check("sdpa", "causal_mask")`

Fixtures:
    submission   the learner's functions and the module's adapters, by name
    reference    the same calls on the course's solution, in float64 (or an adapter's oracle)
    draw         seeded random inputs (`autograde.cases.Draw`)
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pytest

from autograde import misconceptions, registry
from autograde.cases import Draw, Inputs, submission_seed, submitter_of, test_seed
from autograde.compare import CaseResult
from autograde.grading.proxies import LearnerFailed, Proxy
from autograde.grading.session import (
    INFO_KEY,
    SESSIONS_KEY,
    Session,
    TestInfo,
    default_notebook,
    hidden_seed_from_environment,
    report_name,
)

DEFAULT_TIME_LIMIT = 20.0


def pytest_addoption(parser):
    group = parser.getgroup("autograde", "the course's exercise tests")
    group.addoption("--notebook", type=Path, help="the notebook to test (default: the exercise's solution)")
    group.addoption("--seed", type=int, help="seed of the hidden tests (default: $AUTOGRADE_SEED; "
                                             "without either, the hidden tests are not run)")
    group.addoption("--visible-only", action="store_true", help="run the visible tests only")


def pytest_configure(config):
    config.addinivalue_line("markers", "points(value): the points of the test, shared by its parametrised cases")
    config.addinivalue_line("markers", "hidden: inputs drawn from the instructor's seed; reported by name only")
    config.addinivalue_line("markers", "time_limit(seconds): the limit on one call of the learner's code")
    config.addinivalue_line("markers", "uses(*names): the exercise's functions the test calls (for check(ex, name))")


@functools.cache  # asked by every hook of every test
def _exercise_of_module(module) -> object:
    """A test module `test_<id>.py` tests the exercise `<id>` (`registry.test_file`)."""
    return registry.get(Path(module.__file__).stem.removeprefix("test_"))


def _exercise_of(item) -> object:
    return _exercise_of_module(item.module)


def _session(config, exercise) -> Session:
    """The front end's session, or, for a plain `pytest` run, one per exercise made from the options."""
    sessions = config.stash.setdefault(SESSIONS_KEY, {})
    if exercise.id not in sessions:
        from autograde.grading.grade import open_notebook

        seed = config.getoption("--seed")
        seed = seed if seed is not None else hidden_seed_from_environment()
        path = config.getoption("--notebook") or default_notebook(exercise)
        # The hidden inputs the grader drew for this notebook: the submitter's, from its path.
        hidden = None if seed is None else submission_seed(seed, submitter_of(Path(path)))
        sessions[exercise.id] = Session(exercise, lambda: open_notebook(exercise, path), hidden,
                                        config.getoption("--visible-only"))
    return sessions[exercise.id]


def _points(item) -> float:
    marker = item.get_closest_marker("points")
    if marker is None:
        raise pytest.UsageError(f"{item.nodeid} has no @pytest.mark.points(...)")
    return float(marker.args[0])


def pytest_collection_modifyitems(session, config, items):
    kept, dropped = [], []
    cases = Counter(item.function for item in items)
    for item in items:
        exercise = _exercise_of(item)
        run = _session(config, exercise)
        visible = item.get_closest_marker("hidden") is None
        uses = item.get_closest_marker("uses")
        info = TestInfo(report_name(item.nodeid), _points(item) / cases[item.function], visible,
                        (item.function.__doc__ or "").strip().split("\n")[0], tuple(uses.args) if uses else ())
        item.stash[INFO_KEY] = info
        if run.runs(info):
            kept.append(item)
            run.catalogue.append(info)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    info = item.stash.get(INFO_KEY, None)
    run = item.config.stash.get(SESSIONS_KEY, {}).get(_exercise_of(item).id) if info is not None else None
    if run is None or info is None or (report.when != "call" and report.passed):
        return
    if report.failed or report.skipped:
        problems = _problems(call.excinfo) if call.excinfo is not None else ("skipped",)
    else:
        problems = ()
    previous = run.results.get(info.name)
    if previous is not None and previous.problems:
        return  # the first failure (setup or call) is the one to report
    if problems and problems[0].startswith("inputs: "):  # as `assert_same` describes them
        inputs, problems = problems[0].removeprefix("inputs: "), problems[1:]
    else:  # the inputs the test drew, as `assert_same` describes them, else the calls it made
        inputs = _drawn_inputs(item, call.excinfo) or "; ".join(
            _call_text(entry, run.exercise) for entry in getattr(run.submission, "log", [])[:6])
    run.results[info.name] = CaseResult(info.name, info.points, info.visible, info.about, inputs, problems)


def _drawn_inputs(item, excinfo) -> str | None:
    """The one `Inputs` a failing test function holds, described: the same line whichever call failed."""
    for entry in excinfo.traceback if excinfo is not None else ():
        if entry.frame.code.raw is getattr(item, "function", None).__code__:
            drawn = [value for value in entry.locals.values() if isinstance(value, Inputs)]
            return drawn[0].describe() if len(drawn) == 1 else None
    return None


def _call_text(entry: str, exercise) -> str:
    """A logged call, `attend(q (2, 3) float64, ...)`, without the name of the test's own adapter."""
    name = entry.partition("(")[0]
    return entry[len(name) + 1:-1] if name in registry.adapters(exercise) else entry


def _problems(excinfo) -> tuple[str, ...]:
    error = excinfo.value
    if isinstance(error, (AssertionError, LearnerFailed)):
        text = str(error).strip() or "assertion failed"
    elif isinstance(error, pytest.skip.Exception):
        text = f"skipped: {error.msg}"
    else:
        text = f"{type(error).__name__}: {error}"
    return tuple(line for line in text.splitlines() if line.strip())


@pytest.fixture(scope="module")
def exercise(request):
    return _exercise_of_module(request.module)


@pytest.fixture
def submission(request, exercise):
    proxy = _session(request.config, exercise).open()
    marker = request.node.get_closest_marker("time_limit")
    proxy.seconds = float(marker.args[0]) if marker else DEFAULT_TIME_LIMIT
    proxy.log = []
    proxy.test = report_name(request.node.nodeid)
    return proxy


class _Recorded(Proxy):
    """The reference, its calls recorded for the misconceptions a visible test's failure may name."""

    def __init__(self, reference: Proxy):
        super().__init__(reference.exercise)
        self._reference = reference

    def call(self, name: str, args: tuple, kwargs: dict):
        result = self._reference.call(name, args, kwargs)
        misconceptions.recorded(name, args, kwargs, result)
        return result


@pytest.fixture
def reference(request, exercise):
    run = _session(request.config, exercise)
    own = run.reference()
    if request.node.get_closest_marker("hidden") is not None:
        with own.drawn_from(run.hidden_seed):  # this submitter's inputs
            yield own
        return
    token = misconceptions.record(misconceptions.Recorder(exercise.id))
    try:
        yield _Recorded(own)
    finally:
        misconceptions.stop(token)


@pytest.fixture
def draw(request, exercise):
    run = _session(request.config, exercise)
    hidden = request.node.get_closest_marker("hidden") is not None
    return Draw(test_seed(exercise.id, report_name(request.node.nodeid), run.hidden_seed if hidden else None))


def pytest_terminal_summary(terminalreporter, config):
    for run in config.stash.get(SESSIONS_KEY, {}).values():
        if run.open_submission is None or run.submission is None:
            continue
        earned = sum(r.points for r in run.results.values() if not r.problems)
        possible = sum(info.points for info in run.catalogue)
        line = f"{run.exercise.id}: {earned:g} of {possible:g} points from the tests run"
        if run.violations:
            line += "; not allowed: " + "; ".join(v.describe() for v in run.violations) + " (the grader gives 0)"
        terminalreporter.write_sep("-", line)


def pytest_unconfigure(config):
    for run in config.stash.get(SESSIONS_KEY, {}).values():
        run.close()
