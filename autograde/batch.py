"""Grade a class: every student folder x every exercise, side by side, recorded as each finishes.

`<submitted>/<student>/<assignment>/<exercise>.ipynb`, nbgrader's layout. Every student found
gets a row for every exercise, whatever their folder holds; a fault in grading one notebook
costs that row only. With a `Journal`, rows that are already recorded (for the same notebook
bytes) are not graded again, and an interrupted run stops without recording a half-graded row.
"""

from __future__ import annotations

import sys
import threading
import traceback
import unicodedata
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from autograde import sandbox
from autograde.exercises import EXERCISES
from autograde.grade import CRASHED, INVALID, Grade, Prepared, grade_notebook, not_run, prepare
from autograde.cases import Exercise
from autograde.journal import Journal, fingerprint


def students_in(submitted: Path) -> list[str]:
    return sorted(p.name for p in submitted.iterdir() if p.is_dir() and not p.name.startswith("."))


def _same_person(name: str) -> str:
    return unicodedata.normalize("NFKC", name).casefold().strip()


def duplicates(students: list[str]) -> dict[str, list[str]]:
    """Folders whose names differ only in case, Unicode form or spaces: student -> all its folders."""
    groups = defaultdict(list)
    for student in students:
        groups[_same_person(student)].append(student)
    return {student: group for group in groups.values() if len(group) > 1 for student in group}


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


def _link_on_the_way(submitted: Path, student: str, exercise: Exercise) -> str | None:
    for folder in (submitted / student, submitted / student / exercise.assignment):
        if folder.is_symlink():
            return f"{folder.relative_to(submitted)} is a symbolic link, not a folder"
    return None


def grade_one(submitted: Path, student: str, prepared: Prepared, limits: sandbox.Limits,
              others: list[str] | None) -> Grade:
    """One row; never raises for anything a submission can do."""
    if others:
        names = ", ".join(repr(name) for name in others)
        return not_run(prepared, INVALID, f"one student, several folders ({names}): keep one and grade again")
    link = _link_on_the_way(submitted, student, prepared.exercise)
    if link:
        return not_run(prepared, INVALID, link)
    try:
        return grade_notebook(submitted / student / prepared.exercise.notebook, prepared, limits)
    except Exception as exc:  # the grader's own fault on this notebook; the others go on
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return not_run(prepared, CRASHED, f"the grader failed on this notebook: {type(exc).__name__}: {exc} "
                                          f"({Path(where.filename).name}, line {where.lineno})")


def grade_all(submitted: Path, seed: int, jobs: int, limits: sandbox.Limits = sandbox.Limits(),
              assignments: list[str] | None = None, progress: bool = True,
              journal: Journal | None = None) -> list[tuple[str, Grade]]:
    """Every (student, exercise) row, in order; with a journal, recorded as each finishes.

    On KeyboardInterrupt (Ctrl-C, or SIGTERM turned into one) it stops: notebooks being graded
    are not recorded, and the interrupt goes on up.
    """
    students = students_in(submitted)
    twins = duplicates(students)
    prepared = [prepare(exercise, seed) for exercise in exercises_for(submitted, students, assignments)]
    recorded = journal.done() if journal else {}
    stopping = threading.Event()
    grades: dict[tuple[str, str], Grade] = journal.grades() if journal else {}

    def row(student: str, p: Prepared, print_: str) -> None:
        result = grade_one(submitted, student, p, limits, twins.get(student))
        if not stopping.is_set():
            grades[student, p.exercise.id] = result
            if journal:
                journal.record(student, print_, result)

    prints = {(student, p.exercise.id): fingerprint(submitted / student / p.exercise.notebook)
              for student in students for p in prepared}
    tasks = [(student, p, prints[student, p.exercise.id]) for student in students for p in prepared
             if recorded.get((student, p.exercise.id)) != prints[student, p.exercise.id]]
    if recorded:
        print(f"{len(students) * len(prepared) - len(tasks)} notebooks already recorded; grading {len(tasks)}",
              file=sys.stderr)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        with tqdm(total=len(tasks), unit="notebook", disable=not progress) as bar:
            futures = [pool.submit(row, *task) for task in tasks]
            for future in futures:
                future.add_done_callback(lambda _: bar.update())
            for future in futures:
                future.result()
    except BaseException:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        sandbox.stop_fork_server()  # what is running is killed, and its threads return at once
        raise
    pool.shutdown()
    return [(student, grades[student, p.exercise.id]) for student in students for p in prepared]
