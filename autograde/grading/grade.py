"""The grading pipeline for one submitted notebook: load -> verify -> extract -> scan -> test.

The tests are the exercise's pytest module, run in this process (`session.Session`); the
submission's code only ever runs in the sandboxed worker that `sandboxed.SandboxedSubmission`
starts, and the tests reach it through calls. `batch.py` grades a class.
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
from dataclasses import dataclass, field
from pathlib import Path

from autograde.cases import Exercise, submission_seed, submitter_of
from autograde.compare import CaseResult, total
from autograde.grading.proxies import Proxy
from autograde.grading.sandboxed import SandboxedSubmission
from autograde.grading.session import Blocked, Session, catalogue
from autograde.registry import EXERCISES
from autograde.sandbox import client as sandbox
from autograde.submission import extract, forbidden, integrity, notebook

UNISOLATED_NOTE = "graded without isolation: the notebook ran without namespaces"
GRADED, INCOMPLETE, MISSING, INVALID, NOT_ALLOWED, CRASHED, REVIEW = (
    "graded", "incomplete", "missing", "invalid", "not allowed", "crashed", "review")


@dataclass(frozen=True)
class Grade:
    exercise: Exercise
    status: str
    reason: str
    results: tuple[CaseResult, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)  # what else the learner should know
    isolation: str = ""  # how the submission's process was isolated (sandbox.ProcessOutcome)
    seconds: float = 0.0  # how long grading it took (for the class report; not part of the grade)

    @property
    def counted(self) -> bool:
        """Whether the tests that passed earn their points (not when nothing ran, or not allowed)."""
        return self.status in (GRADED, INCOMPLETE, REVIEW)

    @property
    def score(self) -> float:
        return total(result.earned for result in self.results) if self.counted else 0.0

    @property
    def max_score(self) -> float:
        return total(result.points for result in self.results)


def not_run(exercise: Exercise, status: str, reason: str, notes: tuple[str, ...] = ()) -> Grade:
    results = tuple(CaseResult(test.name, test.points, test.visible, test.about, "", (f"not run: {reason}",))
                    for test in catalogue(exercise))
    return Grade(exercise, status, reason, results, notes)


def how_it_ended(outcome: sandbox.ProcessOutcome, limits: sandbox.Limits) -> str:
    if outcome.timed_out:
        return f"was stopped at the {limits.wall_seconds:g} s time limit"
    if outcome.returncode < 0:
        name = signal.Signals(-outcome.returncode).name
        why = ""
        if name == "SIGKILL":  # the kernel's at the CPU time limit, or the memory bound's
            # The kernel counts the limit in ticks and reports the time spent from the scheduler's
            # clock: they differ by a few hundredths (9.92 s for a kill at 10).
            spent = outcome.cpu_seconds or 0.0
            why = (f" at its {limits.cpu_seconds:g} s CPU time limit ({spent:.1f} s spent)"
                   if spent >= 0.95 * limits.cpu_seconds else " (out of memory?)")
        return f"was killed by {name}{why}"
    return f"exited with status {outcome.returncode}"


def summary(results: list[CaseResult], notes: tuple[str, ...]) -> str:
    """The grade's reason in one line: the first cell that failed, and the tests that failed."""
    failed = [r for r in results if not r.passed]
    if failed and len(failed) == len(results):
        tests = f"every test failed, the first with: {failed[0].problems[0]}"
    else:
        tests = f"failed: {', '.join(r.name for r in failed)}" if failed else ""
    return "; ".join(([notes[0]] if notes else []) + ([tests] if tests else []))


def _renamed(path: Path, exercise: Exercise) -> str:
    """A hint when the notebook is missing: one next to it that looks like it, renamed."""
    others = {Path(e.notebook).name for e in EXERCISES.values()}
    try:
        nearby = sorted(p.name for p in path.parent.iterdir() if p.suffix == ".ipynb" and p.name not in others)
    except OSError:
        return ""
    close = [n for n in nearby if n.startswith(exercise.id)] or difflib.get_close_matches(path.name, nearby, 1, 0.75)
    return f"; found {close[0]!r}: rename it {path.name}" if close else ""


def _not_allowed_reason(violations: list[forbidden.Violation]) -> str:
    return "; ".join(v.describe() for v in violations) + ", which this exercise does not allow"


def outside_note(violations: list[forbidden.Violation]) -> tuple[str, ...]:
    """Uses outside the code the graded functions reach: told, not counted."""
    if not violations:
        return ()
    return ("; ".join(v.describe() for v in violations)
            + ": outside the graded functions, so not counted (inside them it would cost the exercise)",)


def open_notebook(exercise: Exercise, path: Path, limits: sandbox.Limits = sandbox.Limits()) -> Proxy:
    """The `submission` of a plain `pytest --notebook` run: the notebook in a sandboxed worker, or,
    when it cannot run, a submission whose every call fails with the reason."""
    try:
        cells = extract.code_cells(notebook.load(path))
    except notebook.NotebookError as exc:
        return Blocked(exercise, str(exc))
    violations, _ = forbidden.scan_graded([(cell.label, cell.source) for cell in cells], exercise)
    if violations:
        return Blocked(exercise, _not_allowed_reason(violations))
    return SandboxedSubmission(exercise, [(cell.number, cell.source, cell.run_as) for cell in cells], limits)


def prepare(exercises: list[Exercise]) -> None:
    """Load now what grading the first notebook of `exercises` loads: nbformat and its validator,
    nbgrader's cell helpers, the released notebooks. A run calls it before it forks its grading
    processes, which then share what each would load for its first notebook (0.3 s of each start)."""
    notebook.skip_iri_grammars()
    integrity.nbgrader_helpers()
    for exercise in exercises:
        integrity.released_notebook(exercise)


def grade_notebook(path: Path, exercise: Exercise, seed: int,
                   limits: sandbox.Limits = sandbox.Limits(), submitter: str | None = None) -> Grade:
    """`seed`: the instructor's secret; the hidden tests draw from `submission_seed(seed, submitter)`,
    the submitter by default read from the path (`<submitter>/<assignment>/<notebook>`)."""
    if path.is_symlink():
        return not_run(exercise, INVALID, f"{exercise.notebook} is a symbolic link, not a notebook")
    if path.is_dir():
        return not_run(exercise, INVALID, f"{exercise.notebook} is a folder, not a notebook")
    if not path.exists():
        return not_run(exercise, MISSING, f"no {exercise.notebook} was submitted{_renamed(path, exercise)}")
    try:
        submitted, read_notes = notebook.load_with_notes(path)
    except notebook.NotebookError as exc:
        return not_run(exercise, INVALID, str(exc))
    changed = read_notes + tuple(f"{integrity.CHANGED}{finding}"
                    for finding in integrity.findings(submitted, integrity.released_notebook(exercise)))
    cells = extract.code_cells(submitted)
    violations, elsewhere = forbidden.scan_graded([(cell.label, cell.source) for cell in cells], exercise)
    changed = outside_note(elsewhere) + changed
    if violations:
        return not_run(exercise, NOT_ALLOWED, _not_allowed_reason(violations), changed)
    session = Session(exercise, lambda: SandboxedSubmission(
        exercise, [(cell.number, cell.source, cell.run_as) for cell in cells], limits),
        submission_seed(seed, submitter_of(path) if submitter is None else submitter))
    code = session.run()
    graded = _grade(session, limits, code)
    evidence = [violation.describe() for violation in forbidden.review([(c.label, c.source) for c in cells], exercise)]
    evidence += session.submission.reviews if session.submission is not None else []
    return _for_review(Grade(exercise, graded.status, graded.reason, graded.results, graded.notes + changed,
                             graded.isolation), evidence)


def _for_review(graded: Grade, evidence: list[str]) -> Grade:
    """A counted grade whose graded code reaches into torch's internals, or whose tests found what
    the contract allows but a rule's intent may not (`Proxy.for_review`): the points stand, and a
    person decides whether it went around a rule (the tripwire and the rules are advisory)."""
    if not evidence or not graded.counted:
        return graded
    before = graded.reason if graded.status == GRADED else f"{graded.status}: {graded.reason}"
    reason = "; ".join(filter(None, [*evidence, before]))
    return dataclasses.replace(graded, status=REVIEW, reason=reason)


def _ended(result: CaseResult | None, not_run_here: str) -> CaseResult | None:
    """A test the ending process cut short says how it ended, as the tests that never ran do."""
    if result is None or not result.problems or not result.problems[0].startswith("not run: the grading process"):
        return result
    return dataclasses.replace(result, problems=(not_run_here,))


def _grade(session: Session, limits: sandbox.Limits, code: int) -> Grade:
    exercise, submission = session.exercise, session.submission
    if not isinstance(submission, SandboxedSubmission) or submission.outcome is None:
        return not_run(exercise, CRASHED, f"the tests could not run (pytest exit code {int(code)})")
    ended = how_it_ended(submission.outcome, limits)
    not_run_here = f"not run: the grading process {ended} {submission.gone}"
    results = tuple(_ended(session.results.get(test.name), not_run_here) or CaseResult(
        test.name, test.points, test.visible, test.about, "", (not_run_here,)) for test in catalogue(exercise))
    notes = [f"the notebook defines no {', '.join(f'`{name}`' for name in submission.missing)}"] \
        if submission.missing else []
    notes += [failure.describe() for failure in submission.failed_cells]
    if submission.gone and submission.outcome.output_tail.strip() and not session.results:
        notes.append(f"its last output:\n{submission.outcome.output_tail.strip()}")
    if submission.violations:
        status, reason = NOT_ALLOWED, _not_allowed_reason(submission.violations)
    elif submission.gone:
        status, reason = INCOMPLETE, f"the grading process {ended} {submission.gone}"
    else:
        status, reason = GRADED, summary(list(results), tuple(notes))
    if submission.outcome.isolation.startswith("session"):  # last: the reason stays about the notebook
        notes.append(f"{UNISOLATED_NOTE} ({submission.outcome.note})")
    return Grade(exercise, status, reason, results, tuple(notes), submission.outcome.isolation)
