"""An interrupted run resumes: no row lost or recorded twice, and the same grades as a run that was not.

A signal (SIGINT, SIGTERM, SIGHUP) at any moment, with one grading process or several: as the
run starts, while a notebook is graded (sent to every process of the run, as a scheduler does),
just before and just after a row is written. The notebook being graded is never recorded; the
resumed run grades it and gives the table of a run that was never stopped. Killed outright, the
run leaves no control group of its submissions behind once it has resumed.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograde.cases import Exercise
from autograde.grading import batch, journal
from autograde.grading.grade import GRADED, Grade
from autograde.registry import EXERCISES
from autograde.sandbox import cgroups
from tests.fixtures.notebooks import ROOT, SEED, answer, learner_notebook, write

pytestmark = [pytest.mark.xdist_group("autograde_resume"), pytest.mark.timeout(900)]  # its module's classes graded once

SDPA = "scaled_dot_product_attention"
SLOW = "import time\ntime.sleep(2)\n"
# Right or wrong by a coin toss: the grader's fixed seeds make it the same toss on every run.
COIN_TOSS = answer("sdpa", SDPA) + """
_exact = scaled_dot_product_attention
def scaled_dot_product_attention(q, k, v, mask=None):
    out, weights = _exact(q, k, v, mask)
    return (out + 1 if torch.rand(()) < 0.5 else out), weights
"""


def write_class(submitted: Path, count: int = 8) -> list[str]:
    students = [f"student-{n:02d}" for n in range(count)]
    for n, student in enumerate(students):
        answers = {SDPA: (SLOW if n % 2 else "") + (COIN_TOSS if n % 3 == 0 else answer("sdpa", SDPA))}
        write(learner_notebook("sdpa", answers), submitted / student / "attention" / "sdpa.ipynb")
    return students


# The grader with a hook in its journal: it sends itself a signal just before or just after
# writing its Nth row (in the process that records, whatever --jobs is).
AT_A_WRITE = """
import os, sys
from autograde.frontends import cli
from autograde.grading import journal
when, signal_number, row = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
write, written = journal.Journal.record, []
def record(self, *args):
    if when == "before" and len(written) + 1 == row:
        os.kill(os.getpid(), signal_number)
    write(self, *args)
    written.append(args)
    if when == "after" and len(written) == row:
        os.kill(os.getpid(), signal_number)
journal.Journal.record = record
sys.exit(cli.main(sys.argv[4:]))
"""


def grade(submitted: Path, out: Path, *extra: str, jobs: int = 2, hook: tuple[str, int, int] | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    arguments = ["grade", str(submitted), "--out", str(out), "--jobs", str(jobs), "--assignment", "attention", *extra]
    start = [sys.executable, "-c", AT_A_WRITE, *map(str, hook)] if hook else [sys.executable, "-m", "autograde"]
    return subprocess.Popen([*start, *arguments], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)


def recorded(out: Path) -> list[tuple[str, str]]:
    try:
        with sqlite3.connect(f"file:{out / journal.FILE}?mode=ro", uri=True) as db:
            return db.execute("select student, exercise from grades").fetchall()
    except sqlite3.Error:  # not created yet
        return []


def interrupt_after(process: subprocess.Popen, out: Path, rows: int, how: signal.Signals) -> int:
    deadline = time.monotonic() + 300
    while len(recorded(out)) < rows and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(how)
    process.communicate(timeout=120)
    return process.returncode


def submission_groups() -> dict[Path, int]:
    """The control groups of submissions inside this process's own groups (where its graders make
    theirs, as other runs on this machine may): each with the pid of the fork server that made it."""
    found = {}
    for parent in set(cgroups.own_cgroups().values()):
        for group in parent.glob("autograde-*"):
            made_by = re.fullmatch(r"autograde-(\d+)-\d+", group.name)
            if made_by:
                found[group] = int(made_by.group(1))
    return found


def groups_left(before: dict[Path, int]) -> list[Path]:
    """The groups made since `before` whose fork server has gone: what a run that has ended left."""
    return [group for group, server in submission_groups().items()
            if group not in before and not Path(f"/proc/{server}").exists()]


def graded_by(process: subprocess.Popen) -> list[Path]:
    """The groups of the submissions that `process`'s fork servers are grading now."""
    servers = set(descendants(process.pid))
    return [group for group, server in submission_groups().items() if server in servers]


def descendants(pid: int) -> list[int]:
    found, waiting = [], [pid]
    while waiting:
        parent = waiting.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            waiting += children
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    submitted = base / "submitted"
    students = write_class(submitted)
    whole = grade(submitted, base / "whole", "--seed", str(SEED))
    whole_output = whole.communicate(timeout=600)
    assert whole.returncode == 0, whole_output[1][-3000:]

    stopped = {}
    for how in (signal.SIGTERM, signal.SIGKILL):
        out = base / how.name
        temporary = base / f"tmp-{how.name}"  # the run's TMPDIR: what it leaves there
        temporary.mkdir()
        code = interrupt_after(grade(submitted, out, "--seed", str(SEED), env={**os.environ, "TMPDIR": str(temporary)}),
                               out, 4, how)
        before, table = recorded(out), (out / "grades.csv").exists()
        resumed = grade(submitted, out, "--resume")
        output = resumed.communicate(timeout=600)
        stopped[how] = (code, before, table, resumed.returncode, output)
    return students, base, stopped


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_says_how_to_go_on(runs):
    _, base, stopped = runs
    code, before, table, _, (_, stderr) = stopped[signal.SIGTERM]
    assert code == 128 + signal.SIGTERM
    assert 4 <= len(before) < 16
    assert not table  # no grade table that looks complete but is not


@pytest.mark.slow
def test_a_stopped_run_leaves_no_temporary_folder(runs):
    """Its grading processes were killed mid-notebook: their jobs' folders went with the run's."""
    _, base, _ = runs
    assert list((base / "tmp-SIGTERM").iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "power-cut"])
def test_resuming_grades_only_the_rest_and_gives_the_same_table(runs, how):
    students, base, stopped = runs
    _, before, _, code, (_, stderr) = stopped[how]
    assert code == 0, stderr[-3000:]
    assert f"{len(before)} notebooks already recorded; grading {16 - len(before)}" in stderr
    rows = recorded(base / how.name)
    assert sorted(rows) == sorted(set(rows)) == sorted((s, e) for s in students for e in ("sdpa", "mha"))
    assert (base / how.name / "grades.csv").read_text() == (base / "whole" / "grades.csv").read_text()


@pytest.mark.slow
def test_the_coin_toss_lands_the_same_way_on_every_run(runs):
    _, base, _ = runs
    lines = (base / "whole" / "grades.csv").read_text().splitlines()
    tossed = [line.split(",") for line in lines
              if line.startswith(("student-00,sdpa", "student-03,sdpa", "student-06,sdpa"))]
    assert len(tossed) == 3
    assert any(score != "10" for _, _, score, *_ in tossed)  # the toss cost something: a real test of repeatability


@pytest.mark.slow
def test_resuming_with_another_seed_is_refused(runs, tmp_path):
    _, base, _ = runs
    process = grade(base / "submitted", base / "whole", "--resume", "--seed", str(SEED + 1))
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert f"used seed {SEED}, not {SEED + 1}" in stderr


SMALL_CLASS = 4  # students; 8 notebooks, of which the 4 sdpa ones run (mha is missing)


@pytest.fixture(scope="module")
def small_class(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """A class of SMALL_CLASS students graded once without a stop; the environment that gives the seed."""
    base = tmp_path_factory.mktemp("moments")
    submitted = base / "submitted"
    write_class(submitted, SMALL_CLASS)
    environment = {**os.environ, "AUTOGRADE_SEED": str(SEED)}  # so that a run stopped before its journal resumes
    whole = grade(submitted, base / "whole", jobs=1, env=environment)
    assert whole.communicate(timeout=600) and whole.returncode == 0
    return submitted, base / "whole", environment


def _wait(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in 5 minutes"
        time.sleep(0.02)


# (--jobs, moment, signal): every moment with one grading process and with two, every signal.
MOMENTS = [(1, "start-up", signal.SIGTERM), (1, "mid-notebook", signal.SIGTERM), (1, "before-write", signal.SIGHUP),
           (1, "after-write", signal.SIGINT), (1, "killed", signal.SIGKILL),
           (2, "start-up", signal.SIGINT), (2, "mid-notebook", signal.SIGHUP), (2, "before-write", signal.SIGTERM),
           (2, "after-write", signal.SIGTERM)]


@pytest.mark.slow
@pytest.mark.parametrize("jobs, moment, how", MOMENTS, ids=[f"jobs{j}-{m}-{s.name}" for j, m, s in MOMENTS])
def test_a_signal_at_any_moment_changes_no_grade(small_class, tmp_path, jobs, moment, how):
    submitted, whole, environment = small_class
    out = tmp_path / "out"
    hook = (moment.removesuffix("-write"), how, 2) if moment.endswith("-write") else None
    groups_before = submission_groups()
    process = grade(submitted, out, jobs=jobs, hook=hook, env=environment)
    if moment == "start-up":  # as the grading processes and their fork servers start
        _wait(lambda: (out / journal.FILE).exists(), process, "journal")
        time.sleep(1)
        process.send_signal(how)
    elif moment in ("mid-notebook", "killed"):  # every process of the run, as a job scheduler signals
        _wait(lambda: len(recorded(out)) >= 2 and graded_by(process), process, "notebook in its sandbox")
        for pid in [process.pid, *descendants(process.pid)]:
            try:
                os.kill(pid, how)
            except ProcessLookupError:
                pass
    _, stderr = process.communicate(timeout=300)
    rows = recorded(out)
    if moment == "killed":
        assert process.returncode == -how
    else:
        assert process.returncode == 128 + how, stderr[-3000:]
        assert f"interrupted by {how.name}" in stderr
        assert not groups_left(groups_before)  # the run's fork servers removed theirs as they stopped
    assert len(rows) < 2 * SMALL_CLASS and not (out / "grades.csv").exists()
    if moment == "before-write":
        assert len(rows) == 1
    elif moment == "after-write":
        assert len(rows) == 2
    resumed = grade(submitted, out, "--resume", jobs=jobs, env=environment)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert (out / "grades.csv").read_text() == (whole / "grades.csv").read_text()
    assert not groups_left(groups_before)  # even those of a run killed outright, removed as the next one started


def test_a_grade_that_comes_back_after_a_signal_is_not_recorded(tmp_path, monkeypatch):
    """The flag decides, not the exception: pytest, which runs a notebook's tests, turns the
    KeyboardInterrupt a signal raises into an exit code and returns a grade as if the notebook had
    finished. That grade, and every one after the signal, stays out of the journal."""
    submitted = tmp_path / "submitted"
    for student in ("ada", "bob", "cy"):
        (submitted / student / "attention").mkdir(parents=True)
        (submitted / student / "attention" / "sdpa.ipynb").write_text(student)
    graded: list[tuple[str, str]] = []

    def grade_one(submitted, student: str, exercise: Exercise, *rest) -> Grade:
        graded.append((student, exercise.id))
        if len(graded) == 3:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)  # the handler raises here, and the code in between swallows it
            except KeyboardInterrupt:
                pass
        return Grade(exercise, GRADED, "", ())

    monkeypatch.setattr(batch, "grade_one", grade_one)
    monkeypatch.setattr(batch, "_stopped_by", [])  # this test's run's, not the process's
    handlers = {number: signal.getsignal(number) for number in batch.STOPPING_SIGNALS}
    record = journal.Journal(tmp_path / "out", SEED, resume=False)
    try:
        batch.stop_on_signals()
        with pytest.raises(batch.Interrupted) as stopped:
            batch.grade_all(submitted, SEED, jobs=1, assignments=["attention"], progress=False, journal=record)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert stopped.value.signum == signal.SIGTERM
    exercises = [e.id for e in EXERCISES.values() if e.assignment == "attention"]
    assert len(graded) == 3 and sorted(record.done()) == sorted(graded[:2])
    assert graded[:2] == [("ada", exercises[0]), ("ada", exercises[1])]
    record.close()
