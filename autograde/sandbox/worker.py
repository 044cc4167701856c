"""What runs inside the sandboxed process: the submission's cells, then the tests' calls.

Run by the fork server (`server.py`) in a scratch folder holding `job.json`. It runs the
notebook's code cells (as in Jupyter, a failing cell does not stop the next), connects to the
grading process over `channel.sock`, says which cells failed and which names are missing, and
then answers calls, one at a time, until told it is done: each call names an adapter of the
exercise's test module or one of the exercise's functions, with arguments in `in/`; the reply
is what the call returned, observed (`observe.observe`) and written to `out/`, or how it
failed. Everything this process sends is untrusted: the submission runs here.
"""

from __future__ import annotations

import builtins
import gc
import itertools
import linecache
import random
import signal
import socket
from pathlib import Path

import numpy
import torch

from autograde import registry
from autograde.sandbox.calls import LearnerCalls
from autograde.sandbox.observe import Failure, failure_from, observe
from autograde.sandbox.wire import MessageReader, decode_arguments, encode_result, read_json, send_message, write_json
from autograde.submission.forbidden import Tripwire


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


def run_cell(number: int, source: str, namespace: dict) -> None:
    filename = f"<cell {number}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def cell_failure(exc: BaseException, number: int, seconds: float) -> Failure:
    if isinstance(exc, TimeLimit):
        return Failure("timeout", "TimeLimit", f"cell {number} was stopped after {seconds:g} s")
    if isinstance(exc, SyntaxError):
        code = f": `{exc.text.strip()}`" if exc.text else ""
        return Failure("exception", type(exc).__name__, exc.msg or "", f"cell {number}, line {exc.lineno}{code}")
    return failure_from(exc)


def call_failure(exc: BaseException, seconds: float) -> Failure:
    if isinstance(exc, TimeLimit):
        return Failure("timeout", "TimeLimit", f"stopped after {seconds:g} s (an endless loop?)")
    return failure_from(exc)


def main(folder: Path) -> None:
    job = read_json(folder / "job.json")
    exercise = registry.get(job["exercise"])
    out = folder / "out"
    out.mkdir()
    torch.set_num_threads(1)
    for seeded in (random.seed, numpy.random.seed, torch.manual_seed):  # unseeded randomness repeats
        seeded(0)
    signal.signal(signal.SIGALRM, _alarm)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    failed_cells = []
    for number, source in job["cells"]:
        write_json(folder / "status.json", {"running": f"cell {number}"})  # read if the process ends here
        try:
            time_limited(job["cell_seconds"], run_cell, number, source, namespace)
        except BaseException as exc:  # as in Jupyter, a failing cell does not stop the next ones
            failure = cell_failure(exc, number, job["cell_seconds"])
            failed_cells.append([number, failure.kind, failure.type_name, failure.message, failure.where])
    # Objects made so far are left out of later collections: a full one during a call would read
    # every page holding them (170 MiB with torch imported), which the fork server counts as memory
    # the call touched (`server._CostWatch`).
    gc.freeze()
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.connect("channel.sock")
    send_message(channel, {"ready": True, "cells": failed_cells,
                           "missing": [name for name in exercise.required if name not in namespace]})
    calls, tripwire, names, reader = LearnerCalls(exercise, namespace), Tripwire(exercise.not_allowed), \
        (f"r{n}" for n in itertools.count()), MessageReader(channel)

    def observed_call(name, args, kwargs):
        with tripwire:
            return observe(calls(name, args, kwargs))

    while (request := reader.read()) is not None and "call" in request:
        seconds = request["seconds"]
        try:
            args = decode_arguments(request["args"], folder / "in")
            kwargs = decode_arguments(request["kwargs"], folder / "in")
            reply = {"result": encode_result(time_limited(seconds, observed_call, request["call"], args, kwargs),
                                             out, names)}
        except BaseException as exc:  # a timeout, a SystemExit, or results that cannot be written
            failure = call_failure(exc, seconds)
            reply = {"failure": [failure.kind, failure.type_name, failure.message, failure.where]}
        reply["violations"] = [[v.name, v.where] for v in tripwire.violations]
        send_message(channel, reply)
    channel.close()
