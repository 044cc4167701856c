"""The grading pipeline for one submitted notebook: load -> extract -> scan -> run in sandbox -> compare.

`prepare` computes, once per exercise and seed, every test case's inputs and the reference's
expected observations (trusted code, in this process). `grade_notebook` then grades one
notebook against them; the submission's code only ever runs in the sandbox's processes.
`batch.py` grades a class.
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from autograde import extract, forbidden, integrity, notebook, reference, report, sandbox, wire
from autograde.cases import Case, Exercise, Inputs, build_inputs
from autograde.compare import CaseResult, compare
from autograde.exercises import EXERCISES
from autograde.observe import Failure

GRADED, INCOMPLETE, MISSING, INVALID, NOT_ALLOWED, CRASHED = (
    "graded", "incomplete", "missing", "invalid", "not allowed", "crashed")


@dataclass(frozen=True)
class Prepared:
    exercise: Exercise
    cases: tuple[tuple[Case, Inputs, dict], ...]  # each case with its inputs and expected observations


def prepare(exercise: Exercise, seed: int) -> Prepared:
    cases = []
    for case in exercise.cases:
        inputs = build_inputs(exercise, case, seed)
        cases.append((case, inputs, reference.expected(exercise, case, inputs)))
    return Prepared(exercise, tuple(cases))


@dataclass(frozen=True)
class Grade:
    exercise: Exercise
    status: str
    reason: str
    results: tuple[CaseResult, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)  # what else the learner should know
    isolation: str = ""  # how the submission's process was isolated (sandbox.ProcessOutcome)

    @property
    def counted(self) -> bool:
        """Whether the tests that passed earn their points (not when nothing ran, or not allowed)."""
        return self.status in (GRADED, INCOMPLETE)

    @property
    def score(self) -> float:
        return sum(result.earned for result in self.results) if self.counted else 0.0

    @property
    def max_score(self) -> float:
        return self.exercise.max_score


def not_run(prepared: Prepared, status: str, reason: str, notes: tuple[str, ...] = ()) -> Grade:
    failure = Failure("not run", "", f"not run: {reason}")
    results = tuple(compare(case, inputs, expected, failure) for case, inputs, expected in prepared.cases)
    return Grade(prepared.exercise, status, reason, results, notes)


def write_job(folder: Path, prepared: Prepared, cells: list[extract.Cell], limits: sandbox.Limits) -> None:
    cases = [
        {"name": case.name, "seconds": min(case.seconds, limits.case_seconds or case.seconds),
         "inputs": wire.encode_inputs(inputs, folder, f"input{index}")}
        for index, (case, inputs, _) in enumerate(prepared.cases)
    ]
    wire.write_json(folder / "job.json", {
        "exercise": prepared.exercise.id, "cell_seconds": limits.cell_seconds,
        "cells": [[cell.number, cell.source] for cell in cells], "cases": cases,
    })


def how_it_ended(outcome: sandbox.ProcessOutcome, limits: sandbox.Limits) -> str:
    if outcome.timed_out:
        return f"was stopped at the {limits.wall_seconds:g} s time limit"
    if outcome.returncode < 0:
        name = signal.Signals(-outcome.returncode).name
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (out of memory or time?)"}.get(name, "")
        return f"was killed by {name}{why}"
    return f"exited with status {outcome.returncode}"


def _entries(result: dict, key: str) -> list:
    entries = result.get(key, [])
    if not isinstance(entries, list):
        raise wire.WireError(f"result.json: {key} is malformed")
    return entries


def _strings(item, count: int) -> list[str]:
    if not (isinstance(item, list) and len(item) == count and all(isinstance(x, (str, int)) for x in item)):
        raise wire.WireError("a result entry is malformed")
    return [str(x)[:2000] for x in item]


def read_outcome(folder: Path, prepared: Prepared, outcome: sandbox.ProcessOutcome,
                 limits: sandbox.Limits) -> Grade:
    ended = how_it_ended(outcome, limits)
    try:
        result = wire.read_json(folder / "out" / "result.json")
        if not isinstance(result, dict) or not isinstance(result.get("cases"), dict):
            raise wire.WireError("result.json is malformed")
        cell_failures = [Failure(*_strings(item, 5)[1:]) for item in _entries(result, "cells")]
        missing = _strings(_entries(result, "missing"), len(_entries(result, "missing")))
        violations = [forbidden.Violation(*_strings(item, 2)) for item in _entries(result, "violations")]
        running = str(result.get("running"))[:200]
        results = []
        for case, inputs, expected in prepared.cases:
            if case.name in result["cases"]:
                got = wire.decode_observations(result["cases"][case.name], folder / "out", expected)
            else:
                got = Failure("not run", "", f"not run: the grading process {ended} during {running}")
            results.append(compare(case, inputs, expected, got))
    except (wire.WireError, OSError) as exc:
        reason = f"the grading process {ended} without a readable result ({exc})"
        tail = outcome.output_tail.strip()
        crashed = not_run(prepared, CRASHED, reason, (f"its last output:\n{tail}",) if tail else ())
        return dataclasses.replace(crashed, isolation=outcome.isolation)
    undefined = [f"the notebook defines no {', '.join(f'`{name}`' for name in missing)}"] if missing else []
    notes = tuple(undefined + [failure.describe() for failure in cell_failures])
    if violations:
        status = NOT_ALLOWED
        reason = "; ".join(v.describe() for v in violations) + ", which this exercise does not allow"
    elif result.get("done") is not True:
        status, reason = INCOMPLETE, f"the grading process {ended} during {running}"
    else:
        status, reason = GRADED, summary(results, notes)
    return Grade(prepared.exercise, status, reason, tuple(results), notes, outcome.isolation)


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


def grade_notebook(path: Path, prepared: Prepared, limits: sandbox.Limits = sandbox.Limits()) -> Grade:
    if path.is_symlink():
        return not_run(prepared, INVALID, f"{prepared.exercise.notebook} is a symbolic link, not a notebook")
    if path.is_dir():
        return not_run(prepared, INVALID, f"{prepared.exercise.notebook} is a folder, not a notebook")
    if not path.exists():
        return not_run(prepared, MISSING, f"no {prepared.exercise.notebook} was submitted{_renamed(path, prepared.exercise)}")
    try:
        submitted = notebook.load(path)
    except notebook.NotebookError as exc:
        return not_run(prepared, INVALID, str(exc))
    changed = tuple(f"{report.CHANGED}{finding}"
                    for finding in integrity.findings(submitted, integrity.released_notebook(prepared.exercise)))
    cells = extract.code_cells(submitted)
    violations = forbidden.scan([(cell.label, cell.source) for cell in cells], prepared.exercise.not_allowed)
    if violations:
        reason = "; ".join(v.describe() for v in violations) + ", which this exercise does not allow"
        return not_run(prepared, NOT_ALLOWED, reason, changed)
    with tempfile.TemporaryDirectory(prefix="autograde-") as scratch:
        work = Path(scratch) / "work"
        work.mkdir()
        write_job(work, prepared, cells, limits)
        outcome = sandbox.run_worker(Path(scratch), limits, prepared.exercise.env)
        graded = read_outcome(work, prepared, outcome, limits)
    return dataclasses.replace(graded, notes=graded.notes + changed)
