"""Fixtures shared by the grader's tests: one class of submissions graded once by the CLI."""

from __future__ import annotations

import csv
import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.implementations import MHA_WRONG, REFERENCE_LOAD
from tests.fixtures.notebooks import ROOT, SEED, learner_notebook, write

# The class graded by `python -m autograde grade`; nbgrader grades the first three too.
CLASS_EXPECTED = {
    # student: {exercise: (score, status)}
    "ada": {"sdpa": (10, "graded"), "mha": (10, "graded")},              # the reference answers
    "bert": {"sdpa": (0, "graded"), "mha": (0, "graded")},               # the untouched release
    "cleo": {"sdpa": (8.5, "graded"), "mha": (8.5, "graded")},           # partly wrong
    "dan": {"sdpa": (0, "invalid"), "mha": (0, "missing")},              # not JSON; nothing else
    "eve": {"sdpa": (0, "invalid"), "mha": (0, "not allowed")},          # empty; calls the module
    "fay": {"sdpa": (10, "graded"), "mha": (0, "not allowed")},          # hides a call from the scan
}
NBGRADER_STUDENTS = ("ada", "bert", "cleo", "fay")


def write_class(submitted: Path) -> None:
    def notebook(student: str, exercise_id: str) -> Path:
        return submitted / student / "attention" / f"{exercise_id}.ipynb"

    for exercise_id in ("sdpa", "mha"):
        write(learner_notebook(exercise_id), notebook("ada", exercise_id))
        write(learner_notebook(exercise_id, blank=True), notebook("bert", exercise_id))
    write(learner_notebook("sdpa", {"causal_mask": (  # top-left aligned: right only for L == S
        "def causal_mask(L, S=None, device=None):\n"
        "    return torch.ones(L, L if S is None else S, dtype=torch.bool, device=device).tril()\n")}),
        notebook("cleo", "sdpa"))
    write(learner_notebook("mha", {"load_torch_mha": REFERENCE_LOAD.split("        if torch_mha")[0]
                                   + "    return module\n"}), notebook("cleo", "mha"))
    notebook("dan", "sdpa").parent.mkdir(parents=True)
    notebook("dan", "sdpa").write_text("def scaled_dot_product_attention(q, k, v, mask=None): ...\n")
    notebook("eve", "sdpa").parent.mkdir(parents=True)
    notebook("eve", "sdpa").write_bytes(b"")
    write(learner_notebook("mha", {"load_torch_mha": REFERENCE_LOAD.replace(
        "    return module", "    torch_mha(torch.zeros(1, 1, torch_mha.embed_dim), torch.zeros(1, 1, "
                            "torch_mha.embed_dim), torch.zeros(1, 1, torch_mha.embed_dim))\n    return module")}),
        notebook("eve", "mha"))
    write(learner_notebook("sdpa"), notebook("fay", "sdpa"))
    hidden = next(v for v in MHA_WRONG if v.name == "hides-torch-sdpa-behind-getattr")
    write(learner_notebook("mha", hidden.answers), notebook("fay", "mha"))


@dataclass(frozen=True)
class ClassGrades:
    submitted: Path
    out: Path
    returncode: int
    stdout: str
    stderr: str
    rows: list[dict]

    def row(self, student: str, exercise: str) -> dict:
        return next(r for r in self.rows if r["student"] == student and r["exercise"] == exercise)


@pytest.fixture(scope="session")
def class_grades(tmp_path_factory) -> ClassGrades:
    """The class above, graded by the instructor's command, as an instructor runs it."""
    base = tmp_path_factory.mktemp("class")
    submitted, out = base / "submitted", base / "grades"
    write_class(submitted)
    process = subprocess.run(
        [sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
         "--seed", str(SEED), "--jobs", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    rows = list(csv.DictReader((out / "grades.csv").open())) if (out / "grades.csv").exists() else []
    return ClassGrades(submitted, out, process.returncode, process.stdout, process.stderr, rows)


# What every session checks as it ends: no process of the tests' is left running, and no test
# wrote into the source tree. The session's process is made a subreaper, so that a process whose
# parent has ended (a fork server's worker, a daemonised QEMU) is still found among its descendants.
PR_SET_CHILD_SUBREAPER = 36


def _git_status() -> str | None:
    found = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                           capture_output=True, text=True)
    return found.stdout if found.returncode == 0 else None


def _descendants(pid: int) -> list[tuple[int, str]]:
    """The live (not zombie) processes below `pid`: (pid, command line)."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        states[int(entry.name)] = fields[0]
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        todo.extend(children.get(child, []))
        if states.get(child) != "Z":
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found.append((child, command.strip()[:200]))
    return found


def _interpreters_own(command: str) -> bool:
    """multiprocessing's resource tracker: started by the interpreter for itself, it ends with it."""
    return "from multiprocessing.resource_tracker import main" in command


def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput"):
        # One of pytest-xdist's processes, one a core: a second torch thread each would only make
        # both wait, and the CPU time the work rules measure would count its spinning.
        import torch

        torch.set_num_threads(1)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    session.config.stash[_STATUS_AT_START] = _git_status()


_STATUS_AT_START = pytest.StashKey[str | None]()


def pytest_sessionfinish(session, exitstatus):
    from autograde.sandbox import client

    client.stop_fork_server()  # the grader's own, kept warm for the whole session on purpose
    problems = []
    is_worker = hasattr(session.config, "workerinput")  # pytest-xdist: each worker checks its own processes,
    is_controller = not is_worker and session.config.getoption("dist", "no") != "no"  # the controller the tree
    if sys.platform == "linux" and not is_controller:
        left = [(pid, command) for pid, command in _descendants(os.getpid()) if not _interpreters_own(command)]
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:  # reap what the subreaper inherited
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        problems += [f"process {pid} still running after the tests: {command}" for pid, command in left]
    before, after = session.config.stash.get(_STATUS_AT_START, None), _git_status()
    changed = sorted(set(after.splitlines()) - set(before.splitlines())) if before is not None and after else []
    if not is_worker and changed:
        problems.append("the tests changed the source tree (git status --porcelain):\n"
                        + "".join(f"  {line}\n" for line in changed))
    if problems:
        session.config.get_terminal_writer().line("\n".join(problems), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
