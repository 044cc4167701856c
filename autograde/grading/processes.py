"""Where the grading processes of `--jobs` come from: multiprocessing's forkserver, warm.

Each grading process needs torch, pytest and the exercises imported, two CPU seconds in a fresh
interpreter. The forkserver, a fresh interpreter that computes nothing, imports them once
(`PRELOADED`) and forks each grading process from there. Never from the run's own process: a
process forked after torch has run a parallel region on more than one thread hangs in its next
one (GNU OpenMP keeps a team whose threads the fork did not copy), whatever the caller computed.

Only the standard library is imported here, so that `python -m autograde grade` can `start` the
forkserver before its own imports: each then takes a core.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal

PRELOADED = ["autograde.grading.forkserver"]  # what a grading process runs, and the forkserver's end with the run
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def context() -> multiprocessing.context.BaseContext:
    """The pool's context, its forkserver started (or kept) with what grading needs imported."""
    start()
    return multiprocessing.get_context("forkserver")


def start() -> None:
    """Start the forkserver now, unless it runs; its imports go on while this process goes on. It
    starts with the stopping signals blocked, as every process it forks then begins: only the run's
    own process decides that a run stops (batch.py); signals sent meanwhile wait here, not lost."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOADED)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING_SIGNALS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def will_grade(argv: list[str]) -> bool:
    """Whether `python -m autograde <argv>` will grade a notebook or a folder: a guess from the command
    line, made before argparse can be (its parser needs the heavy imports). A wrong guess costs only
    time: a zygote or forkserver started for nothing, whose imports take a core of their own."""
    return argv[:1] == ["grade"] and any(os.path.exists(argument) for argument in argv[1:]
                                         if not argument.startswith("-"))


def worth_starting_early(argv: list[str]) -> bool:
    """Whether `python -m autograde <argv>` will grade a folder with several jobs, guessed as
    `will_grade` guesses; where the guess is wrong, a forkserver is started later, by `context`."""
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
    """Stop the forkserver, once what it forked has ended, and wait for it: it does not outlive the
    run (or a test), and its CPU time, with that of every grading process it reaped, counts as this
    process's children's, which `time` and `wait4` report. multiprocessing has no public way: its
    `_stop`, which its own tests use, closes the pipe the forkserver waits on and reaps it."""
    stopping = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stopping is not None:  # without it, the forkserver stops when this process exits
        stopping()
