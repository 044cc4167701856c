"""Run the worker on a submission in a separate, limited process.

The process is `python -I` (no user site, no environment-driven imports, no current folder
on `sys.path`) in a scratch folder, with a scrubbed environment, in a new session, with
resource limits set before it starts (CPU time, address space, file size, open files,
processes) and a wall-clock limit; at the end its whole process group is killed.

Note that the kernel does not apply the process-count limit to root, and root may raise
its own limits: for a real boundary, run the grader as an unprivileged user.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parent.parent
_START_WORKER = "import sys, pathlib; sys.path.insert(0, sys.argv[1]); " \
                "from autograde.worker import main; main(pathlib.Path.cwd())"
OUTPUT_TAIL = 1500


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 300.0
    cpu_seconds: int = 240
    memory_bytes: int = 6 * 2**30
    file_bytes: int = 256 * 2**20
    open_files: int = 256
    extra_processes: int = 32  # on top of those the user already runs (the limit is per user)
    cell_seconds: float = 60.0  # one cell of the notebook
    case_seconds: float | None = None  # one test, if less than the test's own limit


@dataclass(frozen=True)
class ProcessOutcome:
    returncode: int | None  # None when it was stopped at the wall-clock limit
    output_tail: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _user_processes() -> int:
    """Processes and threads of this user now: what RLIMIT_NPROC counts."""
    uid, count = os.getuid(), 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _set_limits(limits: Limits, processes: int):
    settings = (
        (resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 5)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_NPROC, (processes, processes)),
        (resource.RLIMIT_CORE, (0, 0)),
    )

    def apply() -> None:  # runs in the child between fork and exec: no imports, no locks
        for which, value in settings:
            resource.setrlimit(which, value)

    return apply


def scrubbed_environment(folder: Path, extra: Mapping[str, str]) -> dict[str, str]:
    threads = "1"  # one thread per worker: `--jobs` runs several side by side
    return {
        "PATH": os.defpath, "HOME": str(folder), "TMPDIR": str(folder), "USER": "learner",
        "LANG": "C.UTF-8", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads, "PYTHONHASHSEED": "0", **extra,
    }


def run_worker(folder: Path, limits: Limits, extra_env: Mapping[str, str] = {}) -> ProcessOutcome:
    """Run `autograde.worker` in `folder` (which holds its job) and wait for it, or stop it."""
    log = folder / "output.txt"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", _START_WORKER, str(ROOT)],
            cwd=folder, env=scrubbed_environment(folder, extra_env),
            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_limits(limits, _user_processes() + limits.extra_processes),
        )
        try:
            returncode = process.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            try:  # whatever it started in its session goes too
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
    with log.open("rb") as output:
        output.seek(max(0, log.stat().st_size - OUTPUT_TAIL))
        tail = output.read().decode("utf-8", "replace")
    return ProcessOutcome(returncode, tail)
