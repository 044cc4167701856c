"""A notebook's code in a sandboxed worker (`sandbox/worker.py`, forked by the fork server), called
over a Unix socket: arguments out as `.npy` files, results back as `.npy` files and JSON, read
header first (`wire.py`), never unpickled; what a call cost measured by the fork server."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from autograde.cases import Exercise
from autograde.grading.proxies import LearnerFailed, Proxy, describe_arguments
from autograde.observe import CallCost, Failure
from autograde.sandbox import client as sandbox
from autograde.sandbox import isolation, wire
from autograde.submission.forbidden import Violation

# A call after which the worker's tripwire no longer stood (`Tripwire.intact`), or that said nothing of it.
TRIPWIRE_GONE = "code that switched off or changed the not-allowed tripwire"

GRACE = 10.0  # seconds the grading process waits past a call's own limit before it gives up on the worker


class SandboxedSubmission(Proxy):
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
    def cost_measured(self, memory: bool = True) -> Iterator[CallCost]:
        """Measured by the fork server, outside the worker; a process started or ended meanwhile fails it."""
        cost = CallCost("measured from outside them")
        started = self._watch("start", memory)
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
                cost.growth_bytes = int(stopped.get("growth_bytes", 0)) if memory else None
                cost.referenced_bytes = int(stopped.get("referenced_bytes", 0))
                cost.cpu_seconds = float(stopped.get("cpu_seconds", 0.0))

    def _watch(self, phase: str, memory: bool = True) -> dict:
        if self.gone:
            return {"error": f"the grading process ended {self.gone}"}
        try:
            return self._running.watch_cost(phase, memory)
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
