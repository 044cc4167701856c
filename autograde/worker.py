"""What runs inside the sandboxed process: the submission's cells, then each test case's probe.

Run by the fork server (`forkserver.py`) in a scratch folder holding `job.json` and the input arrays.
It writes `result.json` (and the arrays it names) after every step, so that the grading
process knows how far it got if the submission ends or hangs the process. Everything this
process writes is untrusted: the submission runs here and could change any of it.
"""

from __future__ import annotations

import builtins
import linecache
import random
import signal
from pathlib import Path

import numpy
import torch

from autograde import exercises
from autograde.forbidden import Tripwire
from autograde.observe import Failure, failure_from, run_probe
from autograde.wire import decode_inputs, encode_observations, read_json, write_json


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


def case_failure(exc: BaseException, seconds: float) -> Failure:
    if isinstance(exc, TimeLimit):
        return Failure("timeout", "TimeLimit", f"stopped after {seconds:g} s (an endless loop?)")
    return failure_from(exc)


def main(folder: Path) -> None:
    job = read_json(folder / "job.json")
    exercise = exercises.get(job["exercise"])
    out = folder / "out"
    out.mkdir()
    torch.set_num_threads(1)
    for seeded in (random.seed, numpy.random.seed, torch.manual_seed):  # unseeded randomness repeats
        seeded(0)
    signal.signal(signal.SIGALRM, _alarm)
    result = {"running": None, "cells": [], "missing": [], "cases": {}, "violations": [], "done": False}
    tripwire = Tripwire(exercise.not_allowed)

    def save(running: str | None) -> None:
        result["running"] = running
        result["violations"] = [[v.name, v.where] for v in tripwire.violations]
        write_json(out / "result.json", result)

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    with tripwire:
        for number, source in job["cells"]:
            save(f"cell {number}")
            try:
                time_limited(job["cell_seconds"], run_cell, number, source, namespace)
            except BaseException as exc:  # as in Jupyter, a failing cell does not stop the next ones
                failure = cell_failure(exc, number, job["cell_seconds"])
                result["cells"].append([number, failure.kind, failure.type_name, failure.message, failure.where])
        result["missing"] = [name for name in exercise.required if name not in namespace]
        for index, case_job in enumerate(job["cases"]):
            name, seconds = case_job["name"], case_job["seconds"]
            save(f"test {name}")
            inputs = decode_inputs(case_job["inputs"], folder)
            try:
                observed = time_limited(seconds, run_probe, exercise.case(name).probe, namespace, inputs)
                result["cases"][name] = encode_observations(observed, out, f"case{index}")
            except BaseException as exc:  # a timeout, a SystemExit, or results that cannot be written
                result["cases"][name] = encode_observations(case_failure(exc, seconds), out, f"case{index}")
    result["done"] = True
    save(None)
