"""The `submission` and `reference` fixtures' objects: a call by name, its result as observations.

`SandboxedSubmission` runs a notebook's cells in a sandboxed worker (`worker.py`, forked by
the fork server) and sends it each call over a Unix socket; arguments go out as `.npy` files,
results come back as `.npy` files and JSON, read header first (`wire.py`), never unpickled.
`LocalSubmission` makes the same calls on a namespace in this process: the learner's own kernel
for `check()`. `Reference` makes them on the course's solution, in float64, in this process.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import resource
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from autograde import solutions
from autograde.cases import Exercise, Inputs, float_copy
from autograde.rules import CallCost
from autograde.sandbox import client as sandbox
from autograde.sandbox import isolation, wire
from autograde.sandbox.calls import LearnerCalls, callable_names
from autograde.sandbox.observe import Failure, failure_from, observe
from autograde.sandbox.tripwire import Tripwire
from autograde.submission.forbidden import Violation
from autograde.testing import oracle_of

# A call after which the worker's tripwire no longer stood (`Tripwire.intact`), or that said nothing of it.
TRIPWIRE_GONE = "code that switched off or changed the not-allowed tripwire"

GRACE = 10.0  # seconds the grading process waits past a call's own limit before it gives up on the worker


class LearnerFailed(AssertionError):
    """The learner's call raised, ran out of time, or could not run: a failed test, with why."""

    def __init__(self, failure: Failure):
        super().__init__(failure.describe())
        self.failure = failure


def describe_arguments(args: tuple, kwargs: dict) -> str:
    parts = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, Inputs):
            parts.append(value.describe())
        elif isinstance(value, torch.Tensor):
            parts.append(f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}")
        elif isinstance(value, (dict, list, tuple)):
            parts.append(f"a {type(value).__name__} of {len(value)}")
        else:
            parts.append(repr(value))
    return ", ".join(parts)


class _Proxy:
    """`proxy.name(*args, **kwargs)` -> `proxy.call(name, args, kwargs)`, for the exercise's names only."""

    def __init__(self, exercise: Exercise):
        self.exercise = exercise
        self.names = callable_names(exercise)
        self.seconds = 20.0  # the current test's limit for one call
        self.test = ""  # the current test's name
        self.log: list[str] = []  # the calls of the current test, described

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self.names:
            raise AttributeError(f"{type(self).__name__} of {self.exercise.id!r} has no call {name!r}; "
                                 f"the calls are {', '.join(sorted(self.names))}")
        return lambda *args, **kwargs: self.call(name, args, kwargs)

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def cost_measured(self) -> contextlib.AbstractContextManager[CallCost]:
        """`with proxy.cost_measured() as cost:` the calls inside raise the learner's memory by
        `cost.growth_bytes` and take `cost.cpu_seconds` of CPU time, once the block has ended."""
        raise NotImplementedError(f"{type(self).__name__} does not measure what calls cost")


class Reference(_Proxy):
    """The course's solution (`solutions/`), called in this process on float64 copies of the arguments;
    for an adapter with an oracle (`autograde.testing.oracle`), the oracle on the same copies.

    `recording`: also keep each result under `released_fingerprint` of its call, for `expected`."""

    def __init__(self, exercise: Exercise, recording: bool = False):
        super().__init__(exercise)
        self._calls = LearnerCalls(exercise, solutions.namespace(exercise))
        self._oracles = {name: found for name, function in self._calls.adapters.items()
                         if (found := oracle_of(function)) is not None}
        self._cache: dict[str, Any] = {}
        self.recorded: dict[str, Any] | None = {} if recording else None

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        args, kwargs = float_copy(args), float_copy(kwargs)
        key = call_fingerprint(name, args, kwargs)
        if key not in self._cache:
            try:
                result = self._oracles[name](*args, **kwargs) if name in self._oracles \
                    else self._calls(name, args, kwargs)
                self._cache[key] = observe(result)
            except Exception as exc:
                raise RuntimeError(f"the reference fails {self.exercise.id}: {name}: "
                                   f"{failure_from(exc).describe()}") from exc
        if self.recorded is not None:
            released = released_fingerprint(name, args, kwargs)
            if self.recorded.setdefault(released, self._cache[key]) is not self._cache[key]:
                raise RuntimeError(f"two calls of {name} differ only beyond float32's precision: "
                                   "their released expected values would be confused")
        return self._cache[key]


def released_fingerprint(name: str, args: tuple, kwargs: dict) -> str:
    """A call's fingerprint with its values rounded to float32: the same on a learner's machine, whose
    libm may draw the visible tests' float64 inputs a last bit apart from the release's."""
    return call_fingerprint(name, float_copy(args, torch.float32), float_copy(kwargs, torch.float32))


def call_fingerprint(name: str, *values: Any) -> str:
    digest = hashlib.sha256(name.encode())

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"T{value.dtype}{tuple(value.shape)}{value.requires_grad}".encode())
            digest.update(value.detach().contiguous().numpy().tobytes())
        elif isinstance(value, Inputs):
            digest.update(b"I" + value.note.encode())
            feed(dict(value.values))
        elif isinstance(value, dict):
            digest.update(b"D")
            for key, item in value.items():
                digest.update(repr(key).encode())
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            digest.update(repr(value).encode())

    for value in values:
        feed(value)
    return digest.hexdigest()


class LocalSubmission(_Proxy):
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
    def cost_measured(self) -> Iterator[CallCost]:
        """Measured in this process, the learner's own: advisory. Where Linux's /proc lets the peak be
        reset, from what the process holds now; elsewhere (macOS) from its peak so far, which shows
        only a call that goes beyond every earlier one. CPU time: this process's, all its threads.
        Not the memory read or written, which the sandbox counts in a worker made for one notebook: in
        a long-lived kernel, an honest call's allocations reuse more and more pages of its heap."""
        cost = CallCost("measured in your own kernel; the grader measures it from outside")
        try:
            isolation.reset_peak_memory("self")
            start, read_peak = isolation.status_kib("self", "VmRSS") * 1024, _peak_since_reset
        except OSError:
            start, read_peak = _peak_so_far(), _peak_so_far
        cpu = time.process_time()
        try:
            yield cost
        finally:
            cost.growth_bytes = max(0, read_peak() - start)
            cost.cpu_seconds = time.process_time() - cpu

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.log.append(f"{name}({describe_arguments(args, kwargs)})")
        self.sent.setdefault(self.test, []).append((name, args, kwargs))
        try:
            with self.tripwire:
                return observe(self._calls(name, args, kwargs))
        except Exception as exc:
            raise LearnerFailed(failure_from(exc)) from None


def _peak_since_reset() -> int:
    return isolation.status_kib("self", "VmHWM") * 1024


def _peak_so_far() -> int:
    """This process's largest resident size so far, in bytes (getrusage counts kB on Linux, bytes on macOS)."""
    largest = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return largest if sys.platform == "darwin" else largest * 1024


class SandboxedSubmission(_Proxy):
    """A notebook's code in a sandboxed worker; `close()` ends it and says how it ended."""

    def __init__(self, exercise: Exercise, cells: list[tuple], limits: sandbox.Limits,
                 folder: Path | None = None):
        """`cells`: (position, source) or (position, source, execution count) of each code cell, named in
        messages as `extract.cell_label` names them; `folder`: where the job's folders go, kept
        afterwards; by default a temporary one, removed."""
        super().__init__(exercise)
        self.limits = limits
        self._scratch = tempfile.TemporaryDirectory(prefix="autograde-") if folder is None else None
        folder = Path(self._scratch.name) if folder is None else folder
        self._folder = folder
        (folder / "work").mkdir(parents=True)
        server = sandbox.fork_server()
        self._work_folder = server.scratch(folder / "work", limits)
        self._work = self._work_folder.path  # where this process reaches it
        (self._work / "in").mkdir()
        # Held open: the worker owns `work` and could put a link where `in` was.
        self._inputs = os.open(self._work / "in", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        wire.write_json(self._work / "job.json", {"exercise": exercise.id, "cell_seconds": limits.cell_seconds,
                                                  "cells": [list(cell) for cell in cells]})
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound through a descriptor of the folder: a socket's path has at most 107 bytes, and the
        # folder's, through /proc/<server>/root, may have more.
        work = os.open(self._work, os.O_PATH | os.O_DIRECTORY)
        try:
            self._listener.bind(f"/proc/self/fd/{work}/channel.sock")
        finally:
            os.close(work)
        self._listener.listen(1)
        (self._work / "channel.sock").chmod(0o666)  # the worker runs as a uid of its own
        # Taken before the clock starts: waiting for another notebook's turn costs this one nothing.
        self._gpu_turn = sandbox.gpu_turn() if isolation.gets_gpu(exercise.gpu) else None
        self._deadline = time.monotonic() + limits.wall_seconds
        try:
            self._running = server.start(folder, limits, exercise.env, gpu=exercise.gpu, scratch=self._work_folder)
        except BaseException:
            self._end_gpu_turn()
            raise
        self._names = (f"a{n}" for n in itertools.count())
        self._channel: socket.socket | None = None
        self.gone = ""  # why no more calls can be made, once that is so
        self.doing = "its cells"
        self.violations: list[Violation] = []
        self.failed_cells: list[Failure] = []
        self.missing: list[str] = []
        self.outcome: sandbox.ProcessOutcome | None = None
        self._connect()

    def _connect(self) -> None:
        self._listener.settimeout(0.05)
        while self._channel is None:
            try:
                self._channel, _ = self._listener.accept()
            except socket.timeout:
                if self._running.finished or time.monotonic() > self._deadline:
                    self.gone = f"during {self._cell_running()}"
                    return
        self._reader = wire.MessageReader(self._channel)
        ready = self._receive(max(0.1, self._deadline - time.monotonic()))
        if ready is None:
            return
        try:
            self.failed_cells = [Failure(*wire.strings(item, 5)[1:]) for item in wire.entries(ready, "cells")]
            self.missing = wire.strings(wire.entries(ready, "missing"), len(wire.entries(ready, "missing")))
        except wire.WireError as exc:
            self._give_up(f"with a malformed message ({exc})")

    def _cell_running(self) -> str:
        """Which cell the worker said it was running when it stopped (`status.json`, untrusted)."""
        try:
            running = wire.read_json(self._work / "status.json").get("running")
        except (wire.WireError, AttributeError):
            return "the notebook's cells"
        return str(running)[:40] if isinstance(running, str) else "the notebook's cells"

    def _give_up(self, why: str) -> None:
        self.gone = why
        self._running.kill()

    def _receive(self, seconds: float) -> dict | None:
        self._channel.settimeout(seconds)
        try:
            message = self._reader.read()
            while message is not None and "finding" in message:  # sent by the worker as it happened
                self._found([Violation(*wire.strings(message["finding"], 2))])
                message = self._reader.read()
        except socket.timeout:
            self._give_up(f"while it was running {self.doing} (no answer in time)")
            return None
        except (wire.WireError, OSError) as exc:
            self._give_up(f"during {self.doing}, sending what could not be read ({exc})")
            return None
        if message is None:
            self.gone = f"during {self.doing}"
        return message

    @contextlib.contextmanager
    def cost_measured(self) -> Iterator[CallCost]:
        """Measured by the fork server, outside the worker; a process started or ended meanwhile fails it."""
        cost = CallCost("measured from outside them")
        started = self._watch("start")
        try:
            yield cost
        finally:
            stopped = started if "error" in started else self._watch("stop")
            if "error" in stopped:
                cost.problem = f"the memory and CPU time of your process could not be measured ({stopped['error']})"
            elif stopped.get("ended") or stopped.get("started"):
                cost.problem = ("a process of yours ended or started during the call, so its memory and CPU time "
                                "could not be measured: compute in the process that was called")
            else:
                cost.growth_bytes = int(stopped.get("growth_bytes", 0))
                cost.referenced_bytes = int(stopped.get("referenced_bytes", 0))
                cost.cpu_seconds = float(stopped.get("cpu_seconds", 0.0))

    def _watch(self, phase: str) -> dict:
        if self.gone:
            return {"error": f"the grading process ended {self.gone}"}
        try:
            return self._running.watch_cost(phase)
        except sandbox.ForkServerError as exc:
            return {"error": str(exc)}

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.log.append(f"{name}({describe_arguments(args, kwargs)})")
        if self.gone:
            raise LearnerFailed(Failure("not run", "", f"not run: the grading process ended {self.gone}"))
        self.doing = f"{name}(...)"
        seconds = min(self.seconds, self.limits.case_seconds or self.seconds,
                      max(0.1, self._deadline - time.monotonic()))
        probe = secrets.token_hex(8)
        request = {"call": name, "seconds": seconds, "probe": probe,
                   "args": wire.encode_arguments(list(args), self._inputs, self._names),
                   "kwargs": wire.encode_arguments(kwargs, self._inputs, self._names)}
        try:
            wire.send_message(self._channel, request)
        except OSError:
            self.gone = f"before {self.doing}"
            raise LearnerFailed(Failure("not run", "", f"not run: the grading process ended {self.gone}")) from None
        reply = self._receive(seconds + GRACE)
        _remove_contents(self._inputs)
        if reply is None:
            raise LearnerFailed(Failure("not run", "", f"not run: the grading process ended {self.gone}"))
        try:
            self._found([Violation(*wire.strings(item, 2)) for item in wire.entries(reply, "violations")])
            if reply.get("probe") != probe and all(v.name != TRIPWIRE_GONE for v in self.violations):
                self._found([Violation(TRIPWIRE_GONE, f"during {self.doing}")])
            if "failure" in reply:
                raise LearnerFailed(Failure(*wire.strings(reply["failure"], 4)))
            return wire.decode_result(reply.get("result"), self._work / "out")
        except wire.WireError as exc:
            self._give_up(f"during {self.doing}, sending what could not be read ({exc})")
            raise LearnerFailed(Failure("not run", "", f"not run: the grading process ended {self.gone}")) from None
        finally:
            try:
                out = os.open(self._work / "out", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                pass
            else:
                _remove_contents(out)
                os.close(out)

    def _found(self, violations: list[Violation]) -> None:
        """Kept once found: a later reply cannot take a finding back."""
        self.violations += [v for v in violations if v not in self.violations]

    def _kept_files(self, limit: int = 2**20) -> dict[str, bytes]:
        """The regular files at the top of the scratch folder (not links), each up to `limit` bytes."""
        kept = {}
        for entry in os.scandir(self._work):
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_size <= limit:
                kept[entry.name] = wire.read_bytes(self._work / entry.name, limit)
        return kept

    def _end_gpu_turn(self) -> None:
        if self._gpu_turn is not None:
            self._gpu_turn.close()

    def close(self) -> sandbox.ProcessOutcome:
        if self.outcome is None:
            if self._channel is not None and not self.gone:
                try:
                    wire.send_message(self._channel, {"done": True})
                except OSError:
                    pass
            try:
                self.outcome = self._running.wait()
            finally:  # the tree has ended (with the fork server, if that stopped): its GPU memory is free
                self._end_gpu_turn()
            for resource in (self._channel, self._listener):
                if resource is not None:
                    resource.close()
            os.close(self._inputs)
            if self._work_folder.bounded:
                kept = self._kept_files() if self._scratch is None else {}
                self._work_folder.release()
                for name, data in kept.items():  # a folder asked for is kept: its top-level files, on disk
                    (self._folder / "work" / name).write_bytes(data)
            if self._scratch is not None:
                self._scratch.cleanup()
        return self.outcome


def _remove_contents(folder: int) -> None:
    """Empty the folder open as `folder`, without following links (the worker may have made some)."""
    for name in os.listdir(folder):
        try:
            os.unlink(name, dir_fd=folder)
        except OSError:
            pass
