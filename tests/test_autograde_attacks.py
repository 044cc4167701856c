"""Hostile submissions against the whole grader, as an instructor runs it on a class.

The threat model: whatever a submission does, the grader finishes, every student gets every
row, nobody gains credit their code did not earn, and nothing outside the submission's
scratch folder changes. One class (tests/fixtures/attacks.py: a well-behaved student, a
victim, and one student per attack) is graded once, by the grader in a child process in its
own session with short limits (tests/fixtures/attack_driver.py) and a time limit; afterwards
the test looks for what the attacks left behind (processes, files, connections) and kills
or removes it.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from autograde.grading.session import catalogue, max_score
from autograde.registry import EXERCISES
from autograde.submission import extract, forbidden
from tests.fixtures import attacks
from tests.fixtures.attacks import EXERCISE, STUDENTS, SUBMISSIONS, UNCONTAINED, WORKED
from tests.fixtures.notebooks import ROOT, SEED, learner_notebook

pytestmark = [
    pytest.mark.xdist_group("autograde_attacks"),  # its module's fixtures made once
    pytest.mark.slow,
    pytest.mark.timeout(600),
    # Without root the grader degrades by design (no namespaces, the grader's own uid) and says so;
    # these attacks then succeed. tests/test_autograde_sandbox.py covers that mode.
    pytest.mark.skipif(os.getuid() != 0, reason="the grader's full isolation needs root"),
]

DRIVER = ROOT / "tests" / "fixtures" / "attack_driver.py"
GRADING_SECONDS = 300  # the class takes about two minutes on two cores; then the grader is stopped
GRACE_SECONDS = 1.5  # after the grader exits, before looking: time for a daemon to act
EXERCISES_GRADED = tuple(e.id for e in EXERCISES.values() if e.assignment == EXERCISE.assignment)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


@dataclasses.dataclass(frozen=True)
class Grading:
    returncode: int | None  # None: stopped after GRADING_SECONDS
    stdout: str
    stderr: str
    seconds: float
    out: Path
    rows: list[dict]

    def problem(self) -> str:
        return f"exit status {self.returncode}; its last output:\n{(self.stdout + self.stderr)[-3000:]}"

    def row(self, student: str, exercise: str = "sdpa") -> dict:
        found = [r for r in self.rows if student_of(r["student"]) == student and r["exercise"] == exercise]
        assert len(found) == 1, f"{len(found)} rows for {student!r}, {exercise}; {self.problem()}"
        return found[0]

    def feedback(self, student: str) -> str:
        path = self.out / "feedback" / f"{student}.md"
        return path.read_text(errors="replace") if path.is_file() else ""

    def case_results(self, student: str, exercise: str = "sdpa") -> dict[str, tuple[float, bool]]:
        """Each test's points earned and whether it passed, a parametrised test's every case, from
        results.csv (the feedback folds a parametrised test's cases into one row)."""
        with open(self.out / "results.csv", newline="") as results:
            return {r["test"]: (float(r["points"]), r["status"].startswith("passed")) for r in csv.DictReader(results)
                    if student_of(r["student"]) == student and r["exercise"] == exercise}


@dataclasses.dataclass(frozen=True)
class Attacked:
    ctx: attacks.Context
    grading: Grading
    again: Grading  # the dice-rolling student alone, same seed
    survivors: dict[int, str]
    left_running: list[int]
    connections: list[str]
    before: attacks.Canaries
    after: attacks.Canaries
    planted: list[Path]


def student_of(cell: str) -> str:
    """The student's folder name from its CSV cell, where a quote may keep it from being a formula."""
    return cell[1:] if cell.startswith("'") and cell[1:2] in FORMULA_START else cell


def protected_pids() -> tuple[int, ...]:
    """This process and its ancestors, with their process groups and sessions."""
    found, pid = set(), os.getpid()
    while pid > 1:
        found.add(pid)
        for get in (os.getpgid, os.getsid):
            try:
                found.add(get(pid))
            except OSError:
                pass
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return tuple(sorted(found - {0, 1}))


def grade(submitted: Path, out: Path, env: dict) -> Grading:
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(DRIVER), str(submitted), "--out", str(out), "--seed", str(SEED), "--jobs", "2"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, errors="replace", start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=GRADING_SECONDS)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the grader and what it started there
        stdout, stderr = process.communicate()
        returncode = None
    seconds = time.monotonic() - started
    report = out / "grades.csv"
    rows = list(csv.DictReader(report.open(newline="", errors="replace"))) if report.is_file() else []
    return Grading(returncode, stdout, stderr, seconds, out, rows)


def accepted(listener: socket.socket) -> list[str]:
    """Connections that reached the listener (the kernel queues them even if nobody accepts)."""
    found = []
    while True:
        try:
            connection, address = listener.accept()
        except BlockingIOError:
            return found
        found.append(f"{address[0]}:{address[1]}")
        connection.close()


@pytest.fixture(scope="module")
def attacked() -> Attacked:
    # Not under pytest's private (0700) folder: as an instructor's folder usually is, readable by
    # other users, so that the sandbox is what keeps submissions out of it.
    base = Path(tempfile.mkdtemp(prefix="agattack-class-"))
    base.chmod(0o755)
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.setblocking(False)
    ctx = attacks.Context(base, secrets.token_hex(3), listener.getsockname()[1], protected_pids(), os.getuid(),
                          os.readlink("/proc/self/ns/pid"))
    again = dataclasses.replace(ctx, base=base / "again")
    env = {**os.environ, "AUTOGRADE_SEED": str(SEED), "TMPDIR": str(ctx.tmp)}
    try:
        ctx.tmp.mkdir()
        attacks.make_canaries(ctx)
        attacks.write_class(ctx)
        attacks.write_class(again, ("rolls-dice",))
        before = attacks.Canaries.read(ctx)
        grading = grade(ctx.submitted, ctx.out, env)
        time.sleep(GRACE_SECONDS)
        survivors, left_running = attacks.marked(ctx), attacks.in_test_folder(ctx)
        attacks.kill_leftovers(ctx)
        connections, after, planted = accepted(listener), attacks.Canaries.read(ctx), attacks.planted(ctx)
        attacks.remove_planted(ctx)
        regrading = grade(again.submitted, again.out, env)
        yield Attacked(ctx, grading, regrading, survivors, left_running, connections, before, after, planted)
    finally:
        attacks.kill_leftovers(ctx)
        attacks.remove_planted(ctx)
        listener.close()
        shutil.rmtree(base, ignore_errors=True)


def test_the_grader_finishes_and_exits_0(attacked):
    grading = attacked.grading
    assert grading.returncode == 0, f"the grader did not finish well: {grading.problem()}"
    assert grading.seconds < 240, f"grading the class took {grading.seconds:.0f} s"


def test_every_student_gets_one_row_per_exercise(attacked):
    rows = collections.Counter((student_of(r["student"]), r["exercise"]) for r in attacked.grading.rows)
    expected = collections.Counter((s.student, e) for s in SUBMISSIONS for e in EXERCISES_GRADED)
    assert rows == expected, (f"missing: {sorted(expected - rows)}; extra or repeated: {sorted(rows - expected)}; "
                              f"{attacked.grading.problem()}")


def test_well_behaved_students_get_full_marks(attacked):
    for student in ("ada", "victor"):
        row = attacked.grading.row(student)
        assert (row["status"], float(row["score"]), float(row["max_score"])) == ("graded", 10, 10), row


def test_nobody_gets_points_for_an_exercise_they_did_not_hand_in(attacked):
    for student in STUDENTS:
        for exercise in EXERCISES_GRADED:
            if exercise != "sdpa":
                row = attacked.grading.row(student, exercise)
                assert row["status"] in ("missing", "invalid") and float(row["score"]) == 0, row


def markers(text: str, marker: str) -> list[str]:
    return [line.strip()[:300] for line in text.splitlines() if marker in line]


@pytest.mark.parametrize("submission", SUBMISSIONS, ids=lambda s: re.sub(r"[^\w-]+", "_", s.student).strip("_"))
def test_each_submission_gets_what_its_honest_part_earned(attacked, submission):
    row, feedback = attacked.grading.row(submission.student), attacked.grading.feedback(submission.student)
    about = f"{submission.student} ({submission.about})"
    uncontained = markers(feedback, UNCONTAINED)
    assert not uncontained, f"defence missing: {about} did not run, as it would not have been contained: " \
                            f"{uncontained}"
    worked = markers(feedback, WORKED)
    assert not worked, f"the attack worked: {about}: {worked}"
    expect, status, score = submission.expect, row["status"], float(row["score"])
    assert status in expect.outcomes, f"{about}: status {status!r}, expected one of {sorted(expect.outcomes)}: {row}"
    low, high, *keywords = expect.outcomes[status]
    assert low <= score <= high, f"{about}: score {score}, expected {low} to {high} when {status}: {row}"
    assert float(row["max_score"]) == max_score(EXERCISE), row
    text = (row["reason"] + "\n" + feedback).lower().replace(submission.student.lower(), "")
    assert not keywords or any(k in text for k in keywords), \
        f"{about}: the reason or feedback should say one of {keywords}: {row['reason']!r}"
    if expect.hidden_lost:
        results = attacked.grading.case_results(submission.student)
        hidden = [c.name for c in catalogue(EXERCISE) if not c.visible]
        assert set(hidden) <= set(results), f"{about}: results.csv lacks hidden tests: {sorted(results)}"
        assert not [name for name in hidden if results[name][1]], f"{about}: hidden tests passed: {results}"


def test_no_process_started_by_a_submission_survives_grading(attacked):
    assert not attacked.survivors, f"still running after grading (pid: comm): {attacked.survivors}"
    assert not attacked.left_running, f"processes still running in the scratch folders: {attacked.left_running}"


def test_no_connection_reaches_the_listener(attacked):
    assert not attacked.connections, f"connections from {attacked.connections}"


def test_nothing_outside_the_scratch_folders_changes(attacked):
    assert not attacked.planted, f"files created outside the scratch folders: {[str(p) for p in attacked.planted]}"
    assert attacked.after.notebooks == attacked.before.notebooks, "another student's notebook changed"
    assert attacked.after.course == attacked.before.course, "solutions/ or exercises/ changed"
    assert attacked.after.links == attacked.before.links, "a file outside the report was written through a link"


def test_the_report_holds_only_what_the_grader_wrote(attacked):
    out = attacked.grading.out
    assert (out / "grades.csv").is_file() and not (out / "grades.csv").is_symlink()
    links = [str(p) for p in out.rglob("*") if p.is_symlink()]
    assert not links, f"links in the report: {links}"
    foreign = [str(p) for p in out.rglob(f"{attacked.ctx.stem}*")]
    assert not foreign, f"files written into the report by submissions: {foreign}"


def test_no_csv_cell_starts_a_formula(attacked):
    report = attacked.grading.out / "grades.csv"
    cells = [cell for row in csv.reader(report.open(newline="")) for cell in row] if report.is_file() else []
    formulas = [cell[:80] for cell in cells if cell.startswith(FORMULA_START)]
    assert cells and not formulas, f"cells a spreadsheet would read as formulas: {formulas}"


def test_nothing_a_submission_writes_reaches_the_graders_output(attacked):
    grading = attacked.grading
    assert "agattack-fd" not in grading.stdout + grading.stderr


def test_unseeded_randomness_gets_the_same_grade_in_two_runs(attacked):
    first, second = attacked.grading, attacked.again
    assert second.returncode == 0, second.problem()
    rows = [(r["status"], r["score"]) for r in (first.row("rolls-dice"), second.row("rolls-dice"))]
    assert rows[0] == rows[1], f"two runs with seed {SEED}: {rows}"
    results = [g.case_results("rolls-dice") for g in (first, second)]
    assert results[0] == results[1] and len(results[0]) == len(catalogue(EXERCISE)), results


def test_edits_to_nbgrader_cells_are_reported_beside_the_grade(attacked):
    assert attacked.grading.row("edits-nbgrader-metadata")["changed_from_release"] == "yes"
    assert attacked.grading.row("ada")["changed_from_release"] == ""
    findings = list(csv.DictReader((attacked.grading.out / "integrity.csv").open()))
    edited = [r["finding"] for r in findings if student_of(r["student"]) == "edits-nbgrader-metadata"]
    assert any("has its nbgrader metadata changed (points" in finding for finding in edited), findings
    assert "ada" not in {student_of(r["student"]) for r in findings}


# The review scan: reflection and concurrency shown to a person, each with why; right answers never.

@pytest.mark.parametrize("line, evidence, why", [
    ("    f = vars(F)['soft' + 'max']", "vars(...)", "namespace read or changed by key"),
    ("    f = F.__dict__['softmax']", "F.__dict__", "namespace read or changed by key"),
    ("    f = globals()['F']", "globals(...)", "namespace read or changed by key"),
    ("    f = getattr(torch, '_C')", "getattr(...)", "a private one"),
    ("    f = getattr(q, '_base')", "getattr(...)", "a private one"),
    ("    setattr(F, 'softmax', print)", "setattr(...)", "a library's function replaced"),
    ("    delattr(torch, 'softmax')", "delattr(...)", "a library's function replaced"),
    ("    f = getattr", "getattr under another name", "a name the scan does not read"),
    ("    import gc", "gc", "the grader's tripwire included"),
    ("    import threading", "threading", "calling thread"),
    ("    import _thread", "_thread", "calling thread"),
    ("    from concurrent.futures import ThreadPoolExecutor", "concurrent.futures.ThreadPoolExecutor",
     "calling thread"),
    ("    import multiprocessing", "multiprocessing", "another process"),
    ("    f = torch.multiprocessing.Pool", "torch.multiprocessing.Pool", "another process"),
    ("    import subprocess", "subprocess", "another process"),
    ("    f = os.fork", "os.fork", "another process"),
    ("    import inspect", "inspect", "frames and code objects"),
    ("    from types import FunctionType", "types.FunctionType", "from code objects"),
    ("    from operator import attrgetter", "operator.attrgetter", "a name the scan does not read"),
    ("    f = operator.methodcaller('softmax', -1)", "operator.methodcaller", "a name the scan does not read"),
    ("    f = sys._getframe().f_back.f_locals", ".f_locals", "frames and code objects"),
    ("    f = q.__class__.__subclasses__()", "q.__class__.__subclasses__", "frames and code objects"),
])
def test_the_review_scan_shows_reflection_and_concurrency_with_why(line, evidence, why):
    cells = [("cell 1", "import os\nimport operator\nimport sys\nimport torch\nimport torch.nn.functional as F\n"),
             ("cell 2", f"def causal_mask(L, S=None, device=None):\n    return helper(L)\ndef helper(q):\n{line}\n")]
    [found] = forbidden.review(cells, EXERCISE)
    assert found.name.startswith(evidence + ":") and why in found.name, found
    assert found.where == f"cell 2, line 4: `{line.strip()}`"


def test_the_review_scan_reads_what_runs_at_import_and_changes_objects():
    """A library's function replaced when the notebook runs, by code no graded function reaches."""
    cells = [("cell 1", "import torch\nimport importlib\n"),
             ("cell 2", "def patched(*args):\n    return importlib.import_module('torch').matmul(*args)\n"
                        "torch.Tensor.__matmul__ = patched\n")]
    [found] = forbidden.review(cells, EXERCISE)
    assert found.name.startswith("importlib:") and found.where == "cell 1, line 2: `import importlib`"


def right_answers() -> list:
    """Every right answer of the test suite: the fixtures' and each exercise test module's."""
    from tests import (
        test_exercise_flash,
        test_exercise_gqa_kv_cache,
        test_exercise_rope_mla,
        test_exercise_split_kv_paged_kv,
    )
    from tests.fixtures import implementations
    modules = (test_exercise_flash, test_exercise_gqa_kv_cache, test_exercise_rope_mla,
               test_exercise_split_kv_paged_kv)
    found = [*implementations.SDPA_RIGHT, *implementations.MHA_RIGHT, *test_exercise_flash.PART_OF_WHAT_A_LAUNCH_STORED]
    return found + [variant for module in modules for variant in module.RIGHT]


def test_no_solution_and_no_right_answer_is_shown_for_review():
    flagged = {}
    answers = [(exercise.id, None) for exercise in EXERCISES.values()] + \
        [(variant.exercise, variant) for variant in right_answers()]
    for exercise_id, variant in answers:
        source = learner_notebook(exercise_id, variant.answers if variant else None)
        cells = [(cell.label, cell.source) for cell in extract.code_cells(source)]
        exercise = EXERCISES[exercise_id]
        found = forbidden.review(cells, exercise) + forbidden.scan_graded(cells, exercise)[0]
        if found:
            flagged[variant.name if variant else exercise_id] = [v.describe() for v in found]
    assert len(answers) > len(EXERCISES) + 10 and not flagged, flagged
    for exercise in EXERCISES.values():  # the solution notebooks themselves, every cell
        solution = nbformat.read(ROOT / "solutions" / exercise.notebook, as_version=4)
        cells = [(f"cell {i}", cell.source) for i, cell in enumerate(solution.cells) if cell.cell_type == "code"]
        assert forbidden.review(cells, exercise) == [], exercise.id
