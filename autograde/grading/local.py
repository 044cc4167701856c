"""A learner's functions in their own Jupyter kernel, for `check()` and nbgrader's test cells:
calls observed as the worker observes them, rules measured in the same process (advisory)."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import sys
import time
from typing import Any, Iterator

import torch

from autograde.cases import Exercise
from autograde.grading.proxies import LearnerFailed, Proxy, describe_arguments
from autograde.observe import CallCost, failure_from, observe
from autograde.sandbox import procfs
from autograde.sandbox.calls import LearnerCalls
from autograde.sandbox.tripwire import Tripwire
from autograde.submission.forbidden import Violation


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread within, as in the grader's worker; on as many as before afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LocalSubmission(Proxy):
    """The learner's functions in this process (their own kernel): calls observed as the worker observes them."""

    def __init__(self, exercise: Exercise, namespace: dict):
        super().__init__(exercise)
        self._calls = LearnerCalls(exercise, namespace)
        self.tripwire = Tripwire(exercise.not_allowed)
        self.missing = [name for name in exercise.required if name not in namespace]
        self.sent: dict[str, list[tuple[str, tuple, dict]]] = {}  # test -> its calls, with their arguments

    @property
    def violations(self) -> list[Violation]:
        return self.tripwire.violations

    @contextlib.contextmanager
    def cost_measured(self, memory: bool = True) -> Iterator[CallCost]:
        """Measured in this process, the learner's own: advisory. Where Linux's /proc lets the peak be
        reset, from what the process holds now; elsewhere (macOS) from its peak so far, which shows
        only a call that goes beyond every earlier one. CPU time: this process's, with torch on one
        thread during the call, as in the grader's worker: a kernel's threads (one a core by default)
        spin while they wait for each other, and spin longer the busier the machine, which the
        process's CPU time counts (an honest causal forward measured at more than 0.85x the full one
        while other work shared the cores).
        Not the memory read or written, which the sandbox counts in a worker made for one notebook: in
        a long-lived kernel, an honest call's allocations reuse more and more pages of its heap."""
        cost = CallCost("measured in your own kernel; the grader measures it from outside")
        start, read_peak = 0, None
        if memory:
            _free_heap_returned()
            try:
                procfs.reset_peak_memory("self")
                start, read_peak = procfs.status_kib("self", "VmRSS") * 1024, _peak_since_reset
            except OSError:
                start, read_peak = _peak_so_far(), _peak_so_far
        with one_thread():
            cpu = time.process_time()
            try:
                yield cost
            finally:
                cost.growth_bytes = max(0, read_peak() - start) if read_peak else None
                cost.cpu_seconds = time.process_time() - cpu

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.log.append(f"{name}({describe_arguments(args, kwargs)})")
        self.sent.setdefault(self.test, []).append((name, args, kwargs))
        try:
            with self.tripwire:
                return observe(self._calls(name, args, kwargs))
        except Exception as exc:
            raise LearnerFailed(failure_from(exc)) from None


def _free_heap_returned() -> None:
    """Give the C library's free heap back to the system (glibc's `malloc_trim`), so that the call's
    allocations raise the resident size instead of reusing pages freed by earlier work in this
    long-lived process, which would hide them from the peak. Elsewhere (macOS, musl) nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _peak_since_reset() -> int:
    return procfs.status_kib("self", "VmHWM") * 1024


def _peak_so_far() -> int:
    """This process's largest resident size so far, in bytes (getrusage counts kB on Linux, bytes on macOS)."""
    largest = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return largest if sys.platform == "darwin" else largest * 1024
