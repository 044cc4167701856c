"""A grade depends on the submission alone: two grading runs at once on one machine, or one run
beside a CPU hog, give every notebook the score it gets in a run of its own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.notebooks import ROOT, SEED, answer, learner_notebook, write

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SDPA = "scaled_dot_product_attention"
# Slow enough that the runs overlap for the whole of their grading.
SLOW = "import time\ntime.sleep(1.5)\n"
HOG = "import os\nwhile True:\n    os.getpid()\n"


def write_class(submitted: Path) -> None:
    for n in range(6):
        answers = {SDPA: SLOW + answer("sdpa", SDPA)} if n % 2 else None
        write(learner_notebook("sdpa", answers, blank=n == 5), submitted / f"student-{n}" / "attention" / "sdpa.ipynb")
        write(learner_notebook("mha"), submitted / f"student-{n}" / "attention" / "mha.ipynb")


def grade(submitted: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
                             "--seed", str(SEED), "--jobs", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def table(out: Path, process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return (out / "grades.csv").read_text()


def test_runs_side_by_side_and_beside_a_cpu_hog_give_the_scores_of_a_run_alone(tmp_path: Path):
    submitted = tmp_path / "submitted"
    write_class(submitted)
    alone = table(tmp_path / "alone", grade(submitted, tmp_path / "alone"))
    assert alone.count(",10,10,graded,") == 11  # every notebook but the untouched release

    first = grade(submitted, tmp_path / "first")
    time.sleep(2)  # the second starts while the first is grading
    second = grade(submitted, tmp_path / "second")
    assert table(tmp_path / "first", first) == alone
    assert table(tmp_path / "second", second) == alone

    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    try:
        beside = table(tmp_path / "beside", grade(submitted, tmp_path / "beside"))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert beside == alone
