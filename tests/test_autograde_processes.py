"""Where a run's grading processes come from (`autograde/grading/processes.py`): forked from the
command itself, which holds one thread once its imports are done, and from the forkserver wherever
the caller holds more (a thread that could hold a lock, an OpenMP team that torch left behind)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from autograde.grading import processes
from tests.fixtures.notebooks import ROOT

# What `python -m autograde grade <folder> --jobs 2` does before its pool forks, then the context it gets.
COMMAND_BEFORE_ITS_POOL = """
from autograde.grading import processes
processes.without_blas_threads()
import autograde.frontends.cli
print(processes.context().get_start_method())
"""

# A caller that ran torch on two threads first: its OpenMP team stays, so it must not fork.
AFTER_A_PARALLEL_REGION = """
import torch
from autograde.grading import processes
torch.set_num_threads(2)
torch.ones(2**22).exp()
print(processes.context().get_start_method())
processes.stop()
"""


def start_method(program: str) -> str:
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_command_forks_its_grading_processes_itself_once_its_imports_are_done():
    assert start_method(COMMAND_BEFORE_ITS_POOL) == "fork"


def test_a_caller_holding_other_threads_gets_them_from_the_forkserver():
    assert start_method(AFTER_A_PARALLEL_REGION) == "forkserver"


def test_a_command_that_grades_starts_the_zygote_and_others_do_not(tmp_path: Path):
    assert processes.will_grade(["grade", str(tmp_path), "--jobs", "2"])
    assert processes.will_grade(["grade", "--out", "grades", str(tmp_path)])
    assert not processes.will_grade(["grade", "--help"])
    assert not processes.will_grade(["merge", str(tmp_path)])
    assert processes.will_grade_in_processes(["grade", str(tmp_path), "--jobs=2"])
    assert not processes.will_grade_in_processes(["grade", str(tmp_path), "--jobs", "1"])
