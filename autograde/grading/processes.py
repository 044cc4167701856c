"""Where the grading processes of `--jobs` come from: forked from the run's own process where that
is safe, else from multiprocessing's forkserver, warm.

Each grading process needs torch, pytest and the exercises imported, two CPU seconds in a fresh
interpreter. `python -m autograde grade` imports them anyway and computes nothing with them: where
it holds one thread (`one_thread`), it forks its grading processes, and no other interpreter
imports them again. Not from a process with more threads: a forked child would wait forever on a
lock that another thread held at the fork, or in its next parallel region, where torch had run one
on more than one thread (GNU OpenMP keeps a team whose threads the fork did not copy). There, as
in a test or whatever else calls `batch.grade_all` from its own process, the forkserver, a fresh
interpreter that computes nothing, imports them once (`PRELOADED`) and forks each grading process.

Only the standard library is imported here (and `isolation`, which imports nothing more), so that
`python -m autograde grade` can prepare before its own imports: it imports numpy without OpenBLAS's
thread pool (`without_blas_threads`), the one thread its imports would otherwise start.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
from collections.abc import Iterator

from autograde.sandbox import isolation

PRELOADED = ["autograde.grading.forkserver"]  # what a grading process runs, and the forkserver's end with the run
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def context() -> multiprocessing.context.BaseContext:
    """The pool's context: `fork` where this process holds one thread, else the forkserver, started
    (or kept) with what grading needs imported. Either way its processes begin as `signals_blocked`
    leaves them, when the pool forks them inside it."""
    if one_thread():
        return multiprocessing.get_context("fork")
    start()
    return multiprocessing.get_context("forkserver")


def one_thread() -> bool:
    """Whether this process holds a single thread (`isolation.thread_names`; never assumed where
    /proc cannot say), so that a fork copies nothing half-way."""
    try:
        return len(isolation.thread_names()) == 1
    except OSError:
        return False


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """The stopping signals blocked meanwhile, as every process forked meanwhile then begins: only the
    run's own process decides that a run stops (batch.py); signals sent meanwhile wait, not lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start() -> None:
    """Start the forkserver now, unless it runs; its imports go on while this process goes on. It
    starts with the stopping signals blocked, and so does every process it forks."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOADED)
    with signals_blocked():
        multiprocessing.forkserver.ensure_running()


def without_blas_threads() -> None:
    """Import numpy, whose OpenBLAS would otherwise start a thread for each core but one as it loads,
    without them, so that a command that computes nothing with it holds one thread and forks its
    grading processes (`context`). They keep one BLAS thread: torch, not numpy, computes the tests'
    references, with threads of its own."""
    name = "OPENBLAS_NUM_THREADS"
    given = os.environ.get(name)
    os.environ[name] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        if given is None:
            del os.environ[name]
        else:
            os.environ[name] = given


def will_grade(argv: list[str]) -> bool:
    """Whether `python -m autograde <argv>` will grade a notebook or a folder: a guess from the command
    line, made before argparse can be (its parser needs the heavy imports). A wrong guess costs only
    time: a zygote started for nothing, whose imports take a core of their own."""
    return argv[:1] == ["grade"] and any(os.path.exists(argument) for argument in argv[1:]
                                         if not argument.startswith("-"))


def will_grade_in_processes(argv: list[str]) -> bool:
    """Whether `python -m autograde <argv>` will grade a folder with several jobs, guessed as
    `will_grade` guesses; a wrong guess costs only time (a forkserver started later, by `context`)."""
    if not will_grade(argv):
        return False
    jobs = os.cpu_count() or 1
    for index, argument in enumerate(argv):
        given = argument.split("=", 1)[1] if argument.startswith("--jobs=") else \
            argv[index + 1] if argument == "--jobs" and index + 1 < len(argv) else None
        if given is not None and given.isdigit():
            jobs = int(given)
    return jobs > 1 and any(os.path.isdir(argument) for argument in argv[1:] if not argument.startswith("-"))


def stop() -> None:
    """Stop the forkserver, if one was started, once what it forked has ended, and wait for it: it does
    not outlive the run (or a test), and its CPU time, with that of every grading process it reaped,
    counts as this process's children's, which `time` and `wait4` report. multiprocessing has no public
    way: its `_stop`, which its own tests use, closes the pipe the forkserver waits on and reaps it."""
    stopping = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stopping is not None:  # without it, the forkserver stops when this process exits
        stopping()
