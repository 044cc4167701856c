"""What runs inside the sandboxed process: the submission's cells, then the tests' calls.

Run by the fork server (`server.py`) in a scratch folder holding `job.json`. It runs the
notebook's code cells (as in Jupyter, a failing cell does not stop the next), connects to the
grading process over `channel.sock`, says which cells failed and which names are missing, and
then answers calls, one at a time, until told it is done: each call names an adapter of the
exercise's definition or one of the exercise's functions, with arguments in `in/`; the reply
is what the call returned, observed (`observe.observe`) and written to `out/`, or how it
failed. Everything this process sends is untrusted: the submission runs here.

What the tripwire finds (armed from the first call to the last), and a thread the notebook starts,
is sent at once as a `finding` line, before the reply: learner code that empties the tripwire
afterwards cannot take it back. Each reply carries the call's `probe` (a token of the grading
process's, sent with the request) only if the tripwire still stood when the call ended
(`Tripwire.intact`).
"""

from __future__ import annotations

import _thread
import builtins
import gc
import itertools
import linecache
import random
import signal
import socket
import threading
import traceback
from pathlib import Path

import numpy
import torch

from autograde import registry
from autograde.observe import Failure, failure_from, learner_line, observe
from autograde.sandbox.calls import LearnerCalls
from autograde.sandbox.tripwire import Tripwire
from autograde.sandbox.wire import MessageReader, decode_arguments, encode_result, read_json, send_message, write_json
from autograde.submission.extract import cell_label
from autograde.submission.forbidden import Violation

# What a thread started by the notebook is reported as: the rules' dispatch modes are thread-local,
# so work done in another thread escapes them.
THREAD_STARTED = "a thread started during a call (the rules watch the calling thread alone)"
THREAD_RUNNING = ("a thread the notebook started, running beside the tests' calls (the rules watch the calling "
                  "thread alone)")


class TimeLimit(BaseException):
    """Raised by the alarm; a BaseException so that `except Exception` in a submission lets it pass."""


def _alarm(signum, frame):
    raise TimeLimit


def time_limited(seconds: float, function, *args):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return function(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_cell(label: str, source: str, namespace: dict) -> None:
    filename = f"<{label}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def cell_failure(exc: BaseException, label: str, seconds: float) -> Failure:
    if isinstance(exc, TimeLimit):
        return Failure("timeout", "TimeLimit", f"{label} was stopped after {seconds:g} s")
    if isinstance(exc, SyntaxError):
        code = f": `{exc.text.strip()}`" if exc.text else ""
        return Failure("exception", type(exc).__name__, exc.msg or "", f"{label}, line {exc.lineno}{code}")
    return failure_from(exc)


def call_failure(exc: BaseException, seconds: float) -> Failure:
    if isinstance(exc, TimeLimit):
        return Failure("timeout", "TimeLimit", f"stopped after {seconds:g} s (an endless loop?)")
    return failure_from(exc)


class Threads:
    """The Python threads the notebook starts (`threading`, `concurrent.futures` and `_thread` all
    start them through `_thread.start_new_thread`, replaced here before the first cell runs): one
    started during a call is reported as it starts; one still running when a call starts or ends, by
    `check`."""

    def __init__(self):
        self.report = None  # set once the channel is open; calls run only then
        self.running: set[int] = set()
        original = _thread.start_new_thread

        def start_new_thread(function, args, kwargs=None):
            def run(*args, **kwargs):
                self.running.add(_thread.get_ident())
                try:
                    return function(*args, **kwargs)
                finally:
                    self.running.discard(_thread.get_ident())
            if self.report is not None:
                self.report(Violation(THREAD_STARTED, learner_line(traceback.extract_stack())))
            return original(run, args, kwargs or {})

        _thread.start_new_thread = threading._start_new_thread = start_new_thread

    def check(self) -> None:
        if self.running and self.report is not None:
            self.report(Violation(THREAD_RUNNING, ""))


def main(folder: Path) -> None:
    job = read_json(folder / "job.json")
    exercise = registry.get(job["exercise"])
    out = folder / "out"
    out.mkdir()
    torch.set_num_threads(1)
    for seeded in (random.seed, numpy.random.seed, torch.manual_seed):  # unseeded randomness repeats
        seeded(0)
    signal.signal(signal.SIGALRM, _alarm)
    threads = Threads()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    failed_cells = []
    for number, source, *run_as in job["cells"]:  # (position, source[, execution count])
        label = cell_label(number, *run_as)
        write_json(folder / "status.json", {"running": label})  # read if the process ends here
        try:
            time_limited(job["cell_seconds"], run_cell, label, source, namespace)
        except BaseException as exc:  # as in Jupyter, a failing cell does not stop the next ones
            failure = cell_failure(exc, label, job["cell_seconds"])
            failed_cells.append([number, failure.kind, failure.type_name, failure.message, failure.where])
    # Objects made so far are left out of later collections: a full one during a call would read
    # every page holding them (170 MiB with torch imported), which the fork server counts as memory
    # the call touched (`cost.CostWatch`).
    gc.freeze()
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.connect("channel.sock")
    send_message(channel, {"ready": True, "cells": failed_cells,
                           "missing": [name for name in exercise.required if name not in namespace]})
    reported, sending = [], threading.Lock()  # a thread of the notebook's may report beside the reply

    def report(violation: Violation) -> None:
        """Sent at once, once: on the socket it is out of this process's reach."""
        if violation not in reported:
            reported.append(violation)
            with sending:
                send_message(channel, {"finding": [violation.name, violation.where]})

    calls, tripwire, names, reader = LearnerCalls(exercise, namespace), Tripwire(exercise.not_allowed, report), \
        (f"r{n}" for n in itertools.count()), MessageReader(channel)
    threads.report = report

    def observed_call(request: dict, reply: dict):
        try:
            return observe(calls(request["call"], decode_arguments(request["args"], folder / "in"),
                                 decode_arguments(request["kwargs"], folder / "in")))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)  # the alarm may not cut the check short
            if tripwire.intact():
                reply["probe"] = request.get("probe")

    # Armed once for all the calls, not around each: arming registers a kernel for every not-allowed
    # operator (about 0.4 ms a call); between calls only this loop runs, and the notebook's threads.
    with tripwire:
        while (request := reader.read()) is not None and "call" in request:
            seconds, reply = request["seconds"], {}
            threads.check()
            try:
                reply["result"] = encode_result(time_limited(seconds, observed_call, request, reply), out, names)
            except BaseException as exc:  # a timeout, a SystemExit, or results that cannot be written
                failure = call_failure(exc, seconds)
                reply["failure"] = [failure.kind, failure.type_name, failure.message, failure.where]
            threads.check()
            reply["violations"] = [[v.name, v.where] for v in tripwire.violations]
            with sending:
                send_message(channel, reply)
    channel.close()
