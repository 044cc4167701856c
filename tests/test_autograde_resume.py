"""An interrupted run resumes: no row lost or recorded twice, and the same grades as a run that was not."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograde.grading import journal
from tests.fixtures.notebooks import ROOT, SEED, answer, learner_notebook, write

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SDPA = "scaled_dot_product_attention"
SLOW = "import time\ntime.sleep(2)\n"
# Right or wrong by a coin toss: the grader's fixed seeds make it the same toss on every run.
COIN_TOSS = answer("sdpa", SDPA) + """
_exact = scaled_dot_product_attention
def scaled_dot_product_attention(q, k, v, mask=None):
    out, weights = _exact(q, k, v, mask)
    return (out + 1 if torch.rand(()) < 0.5 else out), weights
"""


def write_class(submitted: Path) -> list[str]:
    students = [f"student-{n:02d}" for n in range(8)]
    for n, student in enumerate(students):
        answers = {SDPA: (SLOW if n % 2 else "") + (COIN_TOSS if n % 3 == 0 else answer("sdpa", SDPA))}
        write(learner_notebook("sdpa", answers), submitted / student / "attention" / "sdpa.ipynb")
    return students


def grade(submitted: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
                             "--jobs", "2", "--assignment", "attention", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


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
        code = interrupt_after(grade(submitted, out, "--seed", str(SEED)), out, 4, how)
        before, table = recorded(out), (out / "grades.csv").exists()
        resumed = grade(submitted, out, "--resume")
        output = resumed.communicate(timeout=600)
        stopped[how] = (code, before, table, resumed.returncode, output)
    return students, base, stopped


def test_sigterm_stops_cleanly_and_says_how_to_go_on(runs):
    _, base, stopped = runs
    code, before, table, _, _ = stopped[signal.SIGTERM]
    assert code == 130
    assert 4 <= len(before) < 16
    assert not table  # no grade table that looks complete but is not


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "power-cut"])
def test_resuming_grades_only_the_rest_and_gives_the_same_table(runs, how):
    students, base, stopped = runs
    _, before, _, code, (_, stderr) = stopped[how]
    assert code == 0, stderr[-3000:]
    assert f"{len(before)} notebooks already recorded; grading {16 - len(before)}" in stderr
    rows = recorded(base / how.name)
    assert sorted(rows) == sorted(set(rows)) == sorted((s, e) for s in students for e in ("sdpa", "mha"))
    assert (base / how.name / "grades.csv").read_text() == (base / "whole" / "grades.csv").read_text()


def test_the_coin_toss_lands_the_same_way_on_every_run(runs):
    _, base, _ = runs
    lines = (base / "whole" / "grades.csv").read_text().splitlines()
    tossed = [line.split(",") for line in lines
              if line.startswith(("student-00,sdpa", "student-03,sdpa", "student-06,sdpa"))]
    assert len(tossed) == 3
    assert any(score != "10" for _, _, score, *_ in tossed)  # the toss cost something: a real test of repeatability


def test_resuming_with_another_seed_is_refused(runs, tmp_path):
    _, base, _ = runs
    process = grade(base / "submitted", base / "whole", "--resume", "--seed", str(SEED + 1))
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert f"used seed {SEED}, not {SEED + 1}" in stderr
