"""Grade a class: every student folder x every exercise, side by side, recorded as each finishes.

`<submitted>/<student>/<assignment>/<exercise>.ipynb`, nbgrader's layout. Every student found
gets a row for every exercise, whatever their folder holds; a fault in grading one notebook
costs that row only. With a `Journal`, rows that are already recorded (for the same notebook
bytes) are not graded again, and an interrupted run stops without recording a half-graded row.

Interruptions (SIGINT, SIGTERM, SIGHUP: `stop_on_signals`) are decided here, in the process that
records, and nowhere else: the grading processes and the fork servers ignore those signals (a
job scheduler sends them to every process of a job), so a notebook cut short by one can never
look finished. Once a signal has arrived nothing more is recorded, whatever comes back after it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.util
import os
import shutil
import signal
import socket
import sqlite3
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import torch
from tqdm import tqdm

from autograde.cases import Exercise
from autograde.grading import processes
from autograde.grading.grade import CRASHED, INVALID, Grade, grade_notebook, not_run, prepare
from autograde.grading.journal import Journal, fingerprint, from_json, to_json
from autograde.grading.provenance import same_person, shard_of
from autograde.registry import EXERCISES
from autograde.sandbox import client as sandbox
from autograde.sandbox import isolation
from autograde.submission import locate, notebook

STOPPING_SIGNALS = processes.STOPPING_SIGNALS
_stopped_by: list[int] = []  # the first stopping signal this run received


class Interrupted(KeyboardInterrupt):
    """The run was told to stop by `signum`; nothing graded from then on is recorded."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum, frame):
    if not _stopped_by:  # once: a second signal must not break the clean-up of the first
        _stopped_by.append(signum)
        raise Interrupted(signum)


def stop_on_signals() -> None:
    """Stop the run on Ctrl-C, SIGTERM (a scheduler's cancel, requeue or time limit) or SIGHUP.

    The handler raises `Interrupted` to cut short what this process waits for, but code between
    here and the notebook may swallow it (pytest turns a KeyboardInterrupt into an exit code), so
    what counts is the flag it sets, which `grade_all` reads before recording anything."""
    _stopped_by.clear()
    for number in STOPPING_SIGNALS:
        signal.signal(number, _on_signal)


def _stop_if_interrupted() -> None:
    if _stopped_by:
        raise Interrupted(_stopped_by[0])


def _grading_process_setup(threads: int, zygote: socket.socket | None, scratch: str) -> None:
    """A grading process of the pool dies with the run, and leaves signals to it (see above: it begins
    with them blocked, `processes.signals_blocked`, and ignores them before it lets them in); its fork server
    inherits the ignored signals, and is forked from the run's zygote where there is one. Its share
    of the cores: torch's default, a thread per core in each of `--jobs` processes, keeps threads
    spinning for cores that the others hold. Its temporary folders (each notebook's job) go in the
    run's `scratch`, which the run removes: a process killed mid-notebook leaves its own behind."""
    tempfile.tempdir = scratch
    isolation.die_with_parent()
    notebook.skip_iri_grammars()
    for number in STOPPING_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING_SIGNALS)
    torch.set_num_threads(threads)
    # A process of the pool ends in os._exit, which skips atexit (and the interpreter's teardown, a
    # second of torch's and triton's) but runs multiprocessing's finalizers: its fork server stops there.
    multiprocessing.util.Finalize(None, sandbox.close_fork_server, exitpriority=0)
    sandbox.use_zygote(zygote)
    start_sandbox()


def start_sandbox() -> None:
    """This process's fork server, started before its first notebook, so that no notebook's time (the
    progress bar's estimate, the class report's slowest notebooks) holds the start. A server that
    cannot start is left for that notebook to meet: its row says why."""
    try:
        sandbox.fork_server()
    except Exception:  # noqa: BLE001 - recorded by the first notebook that needs it
        return


def students_in(submitted: Path) -> list[str]:
    return sorted(p.name for p in submitted.iterdir() if p.is_dir() and not p.name.startswith("."))


def duplicates(students: list[str]) -> dict[str, list[str]]:
    """Folders whose names differ only in case, Unicode form or spaces: student -> all its folders."""
    groups = defaultdict(list)
    for student in students:
        groups[same_person(student)].append(student)
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


class TimeLeft:
    """How long the rest of a run will take, with each notebook weighed by its exercise's cost.

    Exercises differ several-fold (the flash notebooks against `sdpa`), so the time left is the
    sum of each remaining notebook's expected time (the mean so far of its exercise, else of
    every exercise; nothing for a notebook that is missing) shared among the grading processes
    that still have work, never fewer than one notebook's worth.
    """

    def __init__(self, jobs: int):
        self.jobs = max(1, jobs)
        # Sums and counts, not every time measured: the bar asks after each notebook, and a class of
        # 6,000 asked over all the times for each notebook left took a core of its own.
        self.seconds: dict[str, float] = defaultdict(float)
        self.graded: dict[str, int] = defaultdict(int)

    def done(self, exercise_id: str, seconds: float) -> None:
        self.seconds[exercise_id] += seconds
        self.graded[exercise_id] += 1

    def expected(self, exercise_id: str, exists: bool = True) -> float | None:
        if not exists:
            return 0.0
        if self.graded.get(exercise_id):
            return self.seconds[exercise_id] / self.graded[exercise_id]
        graded = sum(self.graded.values())
        return sum(self.seconds.values()) / graded if graded else None

    def left(self, remaining: Mapping[tuple[str, bool], int]) -> float | None:
        """Seconds left for the notebooks still to grade, counted by (exercise id, notebook exists);
        None before any data."""
        counts = {key: count for key, count in remaining.items() if count > 0}
        costs = {key: self.expected(*key) for key in counts}
        if any(cost is None for cost in costs.values()):
            return None
        if not counts:
            return 0.0
        total = sum(costs[key] * count for key, count in counts.items())
        return max(total / min(self.jobs, sum(counts.values())), max(costs.values()))


STARTING = "starting: the grading processes and their sandboxes"
STOPPING = "stopping the grading processes"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "time left: after the first notebook of each exercise"
    minutes, seconds = divmod(round(seconds), 60)
    return f"about {minutes} min {seconds} s left" if minutes else f"about {seconds} s left"


def located(submitted: Path, student: str, exercise: Exercise) -> tuple[Path, tuple[str, ...]]:
    """The student's notebook for the exercise: by its name, else the one in the assignment's
    folder that looks renamed (as Gradescope finds it), with a note; never through a link."""
    path = submitted / student / exercise.notebook
    folder = path.parent
    if path.exists() or path.is_symlink() or not folder.is_dir() or folder.is_symlink() \
            or (submitted / student).is_symlink():
        return path, ()
    notebooks, _ = locate.uploaded_notebooks(folder)
    named = {Path(e.notebook).name for e in EXERCISES.values()}
    found = locate.find(exercise, notebooks, {p for p in notebooks if p.name in named}, folder)
    return (found.path, (found.note,)) if found.path is not None else (path, ())


def grade_one(submitted: Path, student: str, exercise: Exercise, seed: int, limits: sandbox.Limits,
              others: list[str] | None) -> Grade:
    """One row; never raises for anything a submission can do."""
    if others:
        names = ", ".join(repr(name) for name in others)
        return not_run(exercise, INVALID, f"one student, several folders ({names}): keep one and grade again")
    link = _link_on_the_way(submitted, student, exercise)
    if link:
        return not_run(exercise, INVALID, link)
    started = time.monotonic()
    try:
        path, notes = located(submitted, student, exercise)
        grade = grade_notebook(path, exercise, seed, limits, submitter=student)
        return dataclasses.replace(grade, notes=notes + grade.notes, seconds=round(time.monotonic() - started, 3))
    except Exception as exc:  # the grader's own fault on this notebook; the others go on
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return not_run(exercise, CRASHED, f"the grader failed on this notebook: {type(exc).__name__}: {exc} "
                                          f"({Path(where.filename).name}, line {where.lineno})")


def _grade_in_grading_process(submitted: Path, student: str, exercise_id: str, seed: int, limits: sandbox.Limits,
                              others: list[str] | None) -> tuple[int, str]:
    """`grade_one` in a grading process of the pool: the process, and the row as JSON, the journal's format."""
    return os.getpid(), to_json(grade_one(submitted, student, EXERCISES[exercise_id], seed, limits, others))


Task = tuple[str, Exercise]  # (student, exercise)


class ExercisesShared:
    """Which notebook a grading process grades next: one of the exercise it graded last, else of
    another it has graded, else of one that no process has begun, else of the exercise with the most
    notebooks left. A process pays once for each exercise it grades (collecting its tests, the
    visible tests' references, the first calls of its functions); sharing the exercises out between
    processes pays those once in the run where it can, which a small class feels most."""

    def __init__(self, tasks: list[Task]):
        self.left: dict[str, deque[Task]] = defaultdict(deque)  # by exercise, in the run's order
        for task in tasks:
            self.left[task[1].id].append(task)
        self.graded: dict[int, list[str]] = defaultdict(list)  # by process: its exercises, the latest last
        self.begun: set[str] = set()

    def first(self, count: int) -> list[Task]:
        """Tasks for `count` processes that have graded nothing yet: of as many exercises as there are."""
        chosen = []
        while len(chosen) < count and any(self.left.values()):
            chosen.append(self._take(self._unbegun() or self._most_left()))
        return chosen

    def done(self, process: int, exercise_id: str) -> Task | None:
        """`process` has graded a notebook of `exercise_id`: what it grades next, if anything is left."""
        graded = self.graded[process]
        if exercise_id in graded:
            graded.remove(exercise_id)
        graded.append(exercise_id)
        if not any(self.left.values()):
            return None
        mine = next((e for e in reversed(graded) if self.left[e]), None)
        return self._take(mine or self._unbegun() or self._most_left())

    def _unbegun(self) -> str | None:
        """The first exercise with notebooks left that no process has begun."""
        return next((e for e, tasks in self.left.items() if tasks and e not in self.begun), None)

    def _most_left(self) -> str:
        return max(self.left, key=lambda e: len(self.left[e]))

    def _take(self, exercise_id: str) -> Task:
        self.begun.add(exercise_id)
        return self.left[exercise_id].popleft()


def grade_all(submitted: Path, seed: int, jobs: int, limits: sandbox.Limits = sandbox.Limits(),
              assignments: list[str] | None = None, progress: bool = True,
              journal: Journal | None = None, shard: tuple[int, int] = (1, 1)) -> list[tuple[str, Grade]]:
    """Every (student, exercise) row, in order; with a journal, recorded as each finishes.

    With `shard=(K, N)`, only the students of shard K of N (`provenance.shard_of`); the
    exercises are chosen from the whole class, so that every shard grades the same ones.

    pytest runs one session at a time in a process, so `jobs` notebooks are graded side by side
    in as many grading processes (trusted: they run the tests, each with its own fork server, forked
    from the run's zygote where the command started one), which share the exercises out
    (`ExercisesShared`).
    Interrupted (`stop_on_signals`), it stops: notebooks being graded are not recorded, whatever
    they came back with, and `Interrupted` goes on up.
    """
    everyone = students_in(submitted)
    twins = duplicates(everyone)
    chosen = exercises_for(submitted, everyone, assignments)
    students = [s for s in everyone if shard == (1, 1) or shard_of(s, shard[1]) == shard[0]]
    if journal:
        journal.describe(shard, [e.id for e in chosen], students)
    recorded = journal.done() if journal else {}
    grades: dict[tuple[str, str], Grade] = journal.grades() if journal else {}
    prints = {(student, e.id): fingerprint(located(submitted, student, e)[0]) for student in students for e in chosen}
    tasks = [(student, e) for student in students for e in chosen
             if recorded.get((student, e.id)) != prints[student, e.id]]
    if recorded:
        print(f"{len(students) * len(chosen) - len(tasks)} notebooks already recorded; grading {len(tasks)}",
              file=sys.stderr)

    def record(student: str, grade: Grade) -> None:
        _stop_if_interrupted()  # a grade that came back after a signal may be one it cut short
        if journal:
            try:
                journal.record(student, prints[student, grade.exercise.id], grade)
            except (sqlite3.Error, OSError) as exc:  # a full disk, say: this row is told, the run goes on
                grade = dataclasses.replace(grade, notes=grade.notes + (
                    f"not recorded in the journal ({exc}): --resume would grade it again",))
        grades[student, grade.exercise.id] = grade

    exists = {(student, e.id): prints[student, e.id] not in ("missing", "folder") for student, e in tasks}
    remaining = Counter((e.id, exists[student, e.id]) for student, e in tasks)
    clock = TimeLeft(jobs)

    def finished(bar, grade: Grade, student: str) -> None:
        key = (grade.exercise.id, exists[student, grade.exercise.id])
        remaining[key] -= 1
        if key[1]:
            clock.done(grade.exercise.id, grade.seconds)
        bar.set_postfix_str(_duration(clock.left(remaining)), refresh=False)
        bar.update()

    workers = min(jobs, len(tasks))
    prepare(chosen)
    pool, futures, shared = None, {}, ExercisesShared(tasks)  # one notebook per process at a time
    scratch = None
    if workers > 1:
        scratch = tempfile.mkdtemp(prefix="autograde-run-")
        os.chmod(scratch, 0o711)  # each job's folder in it is entered by its submission's uid
        # Each grading process dies with this one (SIGKILL included), and its fork server with it.
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=processes.context(),
                                   initializer=_grading_process_setup,
                                   initargs=(max(1, len(os.sched_getaffinity(0)) // workers),
                                             sandbox.zygote_requests(), scratch))

    def submit(task: Task) -> None:
        student, exercise = task
        futures[pool.submit(_grade_in_grading_process, submitted, student, exercise.id, seed, limits,
                            twins.get(student))] = student

    try:
        if pool is not None:
            with processes.signals_blocked():  # the pool forks its processes at the first notebook,
                for task in shared.first(workers):  # before the progress bar starts a thread (`processes`)
                    submit(task)
        # tqdm puts ", " before a postfix itself; the bar shows at once, saying what the wait is for.
        with tqdm(total=len(tasks), unit="notebook", disable=not progress, postfix=STARTING,
                  bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]") as bar:
            if pool is None and tasks:
                start_sandbox()
                for student, exercise in tasks:
                    _stop_if_interrupted()
                    grade = grade_one(submitted, student, exercise, seed, limits, twins.get(student))
                    record(student, grade)
                    finished(bar, grade, student)
            while futures:  # the process that finished a notebook takes the next
                finished_now, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in finished_now:
                    student = futures.pop(future)
                    grader, row = future.result()
                    grade = from_json(row)
                    record(student, grade)
                    finished(bar, grade, student)
                    following = shared.done(grader, grade.exercise.id)
                    if following:
                        submit(following)
            if pool is not None:
                bar.set_postfix_str(STOPPING)
    except BaseException:
        if pool is not None:
            killed = list(getattr(pool, "_processes", {}).values())
            for process in killed:
                process.kill()  # its fork server, and what that runs, die with it
            pool.shutdown(wait=False, cancel_futures=True)
            processes.stop()
            for process in killed:
                process.join(timeout=5)  # ended before their folders are removed
            shutil.rmtree(scratch, ignore_errors=True)
            _stop_if_interrupted()  # a grading process that a signal ended first breaks the pool
        raise
    if pool is not None:
        pool.shutdown()
        processes.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return [(student, grades[student, e.id]) for student in students for e in chosen]
