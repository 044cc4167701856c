"""The grading pipeline for one submitted notebook: load -> extract -> scan -> run in sandbox -> compare.

`prepare` computes, once per exercise and seed, every test case's inputs and the reference's
expected observations (trusted code, in this process). `grade_notebook` then grades one
notebook against them; the submission's code only ever runs in the worker process.
"""

from __future__ import annotations

import signal
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from autograde import extract, forbidden, notebook, reference, sandbox, wire
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
        return not_run(prepared, CRASHED, reason, (f"its last output:\n{tail}",) if tail else ())
    undefined = [f"the notebook defines no {', '.join(f'`{name}`' for name in missing)}"] if missing else []
    notes = tuple(undefined + [failure.describe() for failure in cell_failures])
    if violations:
        reason = "; ".join(v.describe() for v in violations) + ", which this exercise does not allow"
        return Grade(prepared.exercise, NOT_ALLOWED, reason, tuple(results), notes)
    if result.get("done") is not True:
        reason = f"the grading process {ended} during {running}"
        return Grade(prepared.exercise, INCOMPLETE, reason, tuple(results), notes)
    return Grade(prepared.exercise, GRADED, summary(results, notes), tuple(results), notes)


def summary(results: list[CaseResult], notes: tuple[str, ...]) -> str:
    """The grade's reason in one line: the first cell that failed, and the tests that failed."""
    failed = [r for r in results if not r.passed]
    if failed and len(failed) == len(results):
        tests = f"every test failed, the first with: {failed[0].problems[0]}"
    else:
        tests = f"failed: {', '.join(r.name for r in failed)}" if failed else ""
    return "; ".join(([notes[0]] if notes else []) + ([tests] if tests else []))


def grade_notebook(path: Path, prepared: Prepared, limits: sandbox.Limits = sandbox.Limits()) -> Grade:
    if not path.exists():
        return not_run(prepared, MISSING, f"no {prepared.exercise.notebook} was submitted")
    try:
        submitted = notebook.load(path)
    except notebook.NotebookError as exc:
        return not_run(prepared, INVALID, str(exc))
    cells = extract.code_cells(submitted)
    violations = forbidden.scan([(cell.label, cell.source) for cell in cells], prepared.exercise.not_allowed)
    if violations:
        reason = "; ".join(v.describe() for v in violations) + ", which this exercise does not allow"
        return not_run(prepared, NOT_ALLOWED, reason)
    with tempfile.TemporaryDirectory(prefix="autograde-") as scratch:
        work = Path(scratch) / "work"
        work.mkdir()
        write_job(work, prepared, cells, limits)
        outcome = sandbox.run_worker(Path(scratch), limits, prepared.exercise.env)
        return read_outcome(work, prepared, outcome, limits)


def students_in(submitted: Path) -> list[str]:
    return sorted(p.name for p in submitted.iterdir() if p.is_dir() and not p.name.startswith("."))


def exercises_for(submitted: Path, students: list[str], assignments: list[str] | None) -> list[Exercise]:
    """The exercises of the chosen assignments, by default of those that any student submitted."""
    if assignments is None:
        present = {p.name for student in students for p in (submitted / student).iterdir() if p.is_dir()}
        chosen = [e for e in EXERCISES.values() if e.assignment in present]
        return chosen or list(EXERCISES.values())
    unknown = set(assignments) - {e.assignment for e in EXERCISES.values()}
    if unknown:
        raise ValueError(f"unknown assignment(s): {', '.join(sorted(unknown))}")
    return [e for e in EXERCISES.values() if e.assignment in assignments]


def grade_all(submitted: Path, seed: int, jobs: int, limits: sandbox.Limits = sandbox.Limits(),
              assignments: list[str] | None = None, progress: bool = True) -> list[tuple[str, Grade]]:
    """Grade `<submitted>/<student>/<assignment>/<exercise>.ipynb` for every student and exercise.

    One worker process per (student, exercise), `jobs` of them at a time.
    """
    students = students_in(submitted)
    prepared = [prepare(exercise, seed) for exercise in exercises_for(submitted, students, assignments)]
    tasks = [(student, p) for student in students for p in prepared]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(grade_notebook, submitted / student / p.exercise.notebook, p, limits)
                   for student, p in tasks]
        with tqdm(total=len(futures), unit="notebook", disable=not progress) as bar:
            for future in futures:  # in order; the bar moves as each one is done
                future.add_done_callback(lambda _: bar.update())
            grades = [future.result() for future in futures]
    return [(student, grade) for (student, _), grade in zip(tasks, grades)]
