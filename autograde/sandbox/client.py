"""Run the worker on a submission in an isolated, limited process tree.

A `ForkServer` is one warm interpreter (`server.py`, started with `python -I` and a
scrubbed environment, or forked from the run's zygote, `zygote.py`, which was) that has imported
torch once; every submission is a process tree
forked from it, isolated and limited as that module describes: resource limits (CPU time,
address space, file size, open files, processes), a wall-clock limit, and at the end the
whole tree killed. Running as root, each tree also gets new PID, mount, network and IPC
namespaces, a private read-only root filesystem, its own unprivileged uid (so that the
process-count limit applies and nothing outside its scratch folder can be read or changed)
and its own cgroup (memory, processes and CPU for the whole tree). Without root, or without
CAP_SYS_ADMIN, the same namespaces and private root are made inside a user namespace of the
tree's own, where the kernel allows it. `ProcessOutcome.isolation` says which of these was in
force; `available_isolation` says beforehand which will be.

A grading job's folder holds `work/` (the job and, after the run, the results: everything in
it is untrusted) and `root/` (where the private root filesystem is mounted). `work/` is a tmpfs
of bounded size and inodes wherever a mount can be made (`ForkServer.scratch`), in a mount
namespace of the fork server's, which the grader reaches through `/proc/<server>/root`.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import itertools
import json
import os
import secrets
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping

from autograde.sandbox import cgroups, isolation

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `autograde` package
# The signals that stop a run are the grader's to act on (server.py), from before the server imports
# torch. No garbage collection while it imports (`server.serve` freezes what it imported, then turns
# collection back on): a tenth of the imports' time, and pages that forked processes would copy.
_PREAMBLE = ("import gc, signal, sys; gc.disable(); [signal.signal(s, signal.SIG_IGN) for s in "
             "(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]; sys.path.insert(0, sys.argv[1]); ")
START_SERVER = _PREAMBLE + "from autograde.sandbox.server import serve; serve()"
_START_ZYGOTE = _PREAMBLE + "from autograde.sandbox.zygote import main; main(int(sys.argv[2]))"
OUTPUT_TAIL = 1500
FIRST_UID = 2_100_000_000  # the submissions' uids: far above any real account's
UID_BLOCK, UID_BLOCKS = 4096, 500_000  # up to FIRST_UID + 2**31: still below the largest uid, 2**32 - 2
FULL_ISOLATION = "namespaces+uid+cgroup+seccomp"
WEAKER_ISOLATION = ("submissions ran as processes of your own user, able to read and change what it can; "
                    "run the grader as root for namespaces and an unprivileged uid per submission")
UNISOLATED = ("NOT ISOLATED: this machine refuses both the grader's namespaces (root with CAP_SYS_ADMIN) and "
              "user namespaces (kernel.unprivileged_userns_clone=0, user.max_user_namespaces=0, or a seccomp "
              "profile); each notebook would run without namespaces, able to read what the grader's user can "
              "(without root: the solutions, other students' notebooks, your home) and to reach the network")
SERVER_GRACE = 30.0  # seconds past a notebook's own limit before the grader stops waiting
# Taken from the grader's environment where set: where the loader finds the GPU driver (read once,
# when the fork server starts) and which GPUs the instructor gave this run (read by CUDA in a
# worker with the GPU).
GPU_ENVIRONMENT = ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
# Every grading process and run on this machine takes it before starting a worker with the GPU.
GPU_TURN_LOCK = Path("/tmp/autograde-gpu.lock")


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 300.0
    cpu_seconds: int = 240
    memory_bytes: int = 6 * 2**30
    file_bytes: int = 256 * 2**20
    open_files: int = 256
    extra_processes: int = 64  # processes and threads; without root, on top of the user's own
    cell_seconds: float = 60.0  # one cell of the notebook
    case_seconds: float | None = None  # one test, if less than the test's own limit
    cpus: float = 1.0  # the whole tree's share of the CPU, where a cgroup can be made
    # The scratch folder, a tmpfs of its own where a mount can be made: no submission fills the disk.
    scratch_bytes: int = 768 * 2**20
    scratch_files: int = 4096


@dataclass(frozen=True)
class ProcessOutcome:
    returncode: int | None  # None when it was stopped at the wall-clock limit
    output_tail: str
    isolation: str = ""  # FULL_ISOLATION when fully isolated; see server.py
    note: str = ""  # why the isolation is less than full, if it is
    cpu_seconds: float | None = None  # what the submission's process spent, with the children it reaped

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def scrubbed_environment(home: str, extra: Mapping[str, str] = {}) -> dict[str, str]:
    threads = "1"  # one thread per worker: `--jobs` runs several side by side
    return {
        # Triton's cache lies under TRITON_HOME, else a home found when the fork server imported it
        "PATH": os.defpath, "HOME": home, "TMPDIR": home, "TRITON_HOME": home, "USER": "learner",
        "LANG": "C.UTF-8", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads, "PYTHONHASHSEED": "0", **extra,
    }


def gpu_environment() -> dict[str, str]:
    return {name: os.environ[name] for name in GPU_ENVIRONMENT if name in os.environ}


def _declared_delegation() -> dict[str, str]:
    name = cgroups.DELEGATED_VARIABLE
    return {name: os.environ[name]} if name in os.environ else {}


def declare_delegated_cgroup() -> None:
    """The group this run started in is delegated to its user (`grade --delegated-cgroup`): each
    submission gets a group in it. Before the fork server starts, which reads it."""
    os.environ[cgroups.DELEGATED_VARIABLE] = "1"


def driver_library() -> str | None:
    """The CUDA driver's library, where Triton would look for it in this process: the folder
    `TRITON_LIBCUDA_PATH` names, else the loader's cache (`ldconfig -p`), then `LD_LIBRARY_PATH`;
    the file itself, links resolved, or None where there is none.

    Found here, by the grader, because a worker's uid may not reach it where it lies: on an H100
    VM the driver is a mount of its own, and Triton in the worker found neither path. The worker's
    root binds the file itself at `isolation.DRIVER_FOLDER`, which no closed folder stands before.
    """
    library = isolation.DRIVER_NAMES[0]
    folders = [os.environ["TRITON_LIBCUDA_PATH"]] if os.environ.get("TRITON_LIBCUDA_PATH") else []
    if not folders:
        try:
            cache = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, errors="replace",
                                   timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            cache = ""
        folders = [os.path.dirname(line.rsplit("=>", 1)[-1].strip())
                   for line in cache.splitlines() if library in line and "=>" in line]
        folders += [folder for folder in os.environ.get("LD_LIBRARY_PATH", "").split(":") if folder]
    for folder in folders:
        path = os.path.join(folder, library)
        if os.path.isfile(path):
            return os.path.realpath(path)
    return None


def gpu_turn(lock: Path | None = None) -> BinaryIO:
    """Wait until no worker with the machine's GPUs runs, in any grading process or run on this
    machine, and hold the GPUs until the returned file is closed (or this process ends).

    A GPU's memory and time are beyond the rlimits and the cgroup (THREAT_MODEL.md, "GPUs"), so
    one submission holding them would cost a notebook beside it its grade; one at a time, a
    submission can only cost its own. A lock file (flock) rather than a semaphore, so that runs
    side by side take turns too, and a grader that dies gives its turn back with its descriptors.
    """
    lock = lock or GPU_TURN_LOCK
    while True:
        try:  # not created if there: the sticky /tmp refuses O_CREAT on another user's file
            descriptor = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            try:
                descriptor = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
                break
            except FileExistsError:
                continue  # another grader made it meanwhile
    held = os.fdopen(descriptor, "rb")
    fcntl.flock(held, fcntl.LOCK_EX)
    return held


def read_tail(path: Path, size: int = OUTPUT_TAIL) -> str:
    """The end of an untrusted file: not through a link, only a regular file, at most `size` bytes."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(descriptor, "rb") as file:
        length = os.fstat(descriptor).st_size
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return ""
        file.seek(max(0, length - size))
        return file.read(size).decode("utf-8", "replace")


@dataclass(frozen=True)
class Scratch:
    """A job's `work` folder: `path` is where the grading process reaches it; `bounded` when it is a
    tmpfs of its own, which `release` unmounts (its files go with it)."""
    path: Path
    bounded: bool = False
    release: Callable[[], object] = lambda: None


class _Uids:
    """One uid per running submission, so that no two can signal or count against each other."""

    def __init__(self):
        self._free: list[int] = []
        # A block of its own for each fork server, drawn at random, so that grading runs side by side
        # (each with its own server) seldom share a uid; where namespaces hold, sharing one is harmless.
        self._next = itertools.count(FIRST_UID + secrets.randbelow(UID_BLOCKS) * UID_BLOCK)
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            return self._free.pop() if self._free else next(self._next)

    def give_back(self, uid: int) -> None:  # its supervisor killed every process of it
        with self._lock:
            self._free.append(uid)


class ForkServerError(RuntimeError):
    pass


def _shared_environment() -> dict[str, str]:
    """What every fork server of this run is started with, whether alone or from the zygote."""
    return scrubbed_environment("/nonexistent", {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **gpu_environment()})


def _exercise_variables() -> dict[str, str]:
    """What a fork server needs set before triton loads: the exercises' variables."""
    from autograde.registry import EXERCISES

    return {key: value for exercise in EXERCISES.values() for key, value in exercise.env.items()}


def _own_environment() -> dict[str, str]:
    """The exercises' variables, and whether this run was given a delegated cgroup: known only once
    the run has imported the exercises and read its options, so given to each server as it starts,
    after the zygote's imports."""
    return {**_exercise_variables(), **_declared_delegation()}


class Zygote:
    """The run's zygote (`zygote.py`), the interpreter each of its fork servers is forked from,
    started before the run's own imports. `requests` is the run's end of its socket: a process that
    holds it (`use_zygote`; a grading process is given a copy as it starts) has its fork server
    forked there."""

    def __init__(self):
        self.requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _START_ZYGOTE, str(ROOT), str(theirs.fileno())], cwd="/",
                env=_shared_environment(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True)

    def close(self) -> None:
        """Close the run's end; the zygote ends once its servers have (each when its requests close)."""
        self.requests.close()
        try:
            self.process.wait(timeout=SERVER_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Forked:
    """A fork server that the zygote forked, as `subprocess.Popen` would show it: not a child of this
    process, so watched through a pidfd, from its pid in its first line (`ready`)."""

    def __init__(self, stdin: BinaryIO, stdout: BinaryIO):
        self.stdin, self.stdout = stdin, stdout
        self.pid: int | None = None
        self._pidfd: int | None = None
        self.returncode: int | None = None

    def adopt(self, pid: int) -> None:
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # it ended at once
            self.returncode = 0

    def poll(self) -> int | None:
        if self.returncode is None and self._pidfd is not None and select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = 0  # it has ended; its status is the zygote's to reap
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None and self._pidfd is not None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("fork server", timeout)
        self.returncode = 0
        return 0

    def kill(self) -> None:
        if self.poll() is None and self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def _forked_by_zygote(requests: socket.socket, log: BinaryIO) -> _Forked | None:
    """A fork server forked by the zygote, given its stdin, stdout and stderr with the request; None
    where the zygote has gone (a server is then started alone)."""
    server_in, requests_out = os.pipe()
    replies_in, server_out = os.pipe()
    try:
        socket.send_fds(requests, [json.dumps(_own_environment()).encode()], [server_in, server_out, log.fileno()])
    except OSError:
        os.close(requests_out)
        os.close(replies_in)
        return None
    finally:
        os.close(server_in)
        os.close(server_out)
    return _Forked(os.fdopen(requests_out, "wb"), os.fdopen(replies_in, "rb"))


class ForkServer:
    """The warm interpreter, forked from the run's zygote where this process was given one
    (`use_zygote`), else started alone; `run` may be called from several threads at once."""

    def __init__(self):
        self._log = tempfile.TemporaryFile()
        forked = _forked_by_zygote(_zygote_requests, self._log) if _zygote_requests is not None else None
        self._process = forked or subprocess.Popen(
            [sys.executable, "-I", "-c", START_SERVER, str(ROOT)], cwd="/",
            env={**_shared_environment(), **_own_environment()}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, start_new_session=True,
        )
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[threading.Event, list]] = {}
        self._ids = itertools.count()
        self._uids = _Uids() if os.getuid() == 0 else None
        first = self._process.stdout.readline()
        if not first.startswith(b'{"ready"'):
            raise ForkServerError(f"the fork server did not start: {self._stderr_tail()}")
        started = json.loads(first)
        if forked:
            forked.adopt(started["ready"])
        self._mounts_scratch = started.get("mounts") is True
        threading.Thread(target=self._read_replies, daemon=True).start()

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-OUTPUT_TAIL:].decode("utf-8", "replace")

    def _read_replies(self) -> None:
        for line in self._process.stdout:
            reply = json.loads(line)
            with self._lock:
                event, box = self._waiting.pop(reply.pop("id"), (None, None))
            if event is not None:
                box.append(reply)
                event.set()
        with self._lock:  # the server has gone: nobody waits for it any longer
            for event, _ in self._waiting.values():
                event.set()
            self._waiting.clear()

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def _send(self, message: dict) -> None:
        with self._lock:
            self._process.stdin.write(json.dumps(message).encode() + b"\n")
            self._process.stdin.flush()

    def _expect(self) -> tuple[str, threading.Event, list]:
        ident, event, box = str(next(self._ids)), threading.Event(), []
        with self._lock:
            self._waiting[ident] = (event, box)
        return ident, event, box

    def _ask(self, message: dict) -> dict:
        """Send a request that the server answers at once (it forks nothing), and wait for the answer."""
        ident, event, box = self._expect()
        self._send({"id": ident, **message})
        if not event.wait(SERVER_GRACE) or not box:
            raise ForkServerError(f"the fork server did not answer: {self._stderr_tail()}")
        return box[0]

    def scratch(self, work: Path, limits: Limits) -> Scratch:
        """`work`, an empty folder, made a tmpfs of `limits.scratch_bytes` and `limits.scratch_files`
        inodes, so that no submission can fill the disk or its inodes. It is mounted in the fork
        server's own mount namespace (the submissions' roots are made from it; without root, a user
        namespace's), where it goes with the server however the grader ends, and reached from here
        through `/proc/<server>/root`, which only root or its owner may enter. On the disk where the
        server has no mount namespace of its own (root without CAP_SYS_ADMIN, or no user namespaces)."""
        if self._mounts_scratch:
            reply = self._ask({"mount": str(work), "size": limits.scratch_bytes, "files": limits.scratch_files})
            if reply.get("mounted") is True:
                return Scratch(Path(f"/proc/{self._process.pid}/root{work}"), True,
                               functools.partial(self._ask, {"unmount": str(work)}))
        return Scratch(work)

    def start(self, folder: Path, limits: Limits, env: Mapping[str, str] = {}, gpu: bool = False,
              scratch: Scratch | None = None) -> "Running":
        """Start the worker on the job in `folder/work` (`scratch`: where this process reaches it, if
        not there); `Running.wait` waits for it, or stops it. `gpu`: its root holds the machine's GPU
        devices, for an exercise that runs GPU kernels."""
        work = folder / "work"
        (folder / "root").mkdir()
        uid = self._uids.take() if self._uids else None
        if uid is not None:
            os.chmod(folder, 0o711)
            os.chown(scratch.path if scratch else work, uid, uid)
        driver = driver_library() if isolation.gets_gpu(gpu) else None
        ident, event, box = self._expect()
        self._send({"id": ident, "work": str(work), "new_root": str(folder / "root"), "uid": uid,
                    "package_root": str(ROOT), "limits": asdict(limits), "gpu": gpu, "driver": driver,
                    "env": scrubbed_environment(str(work), {**(gpu_environment() if gpu else {}), **env})})
        return Running(self, ident, event, box, scratch.path if scratch else work, limits, uid)

    def kill(self) -> None:
        """Stop at once; the submissions' processes die with it (each dies with its parent)."""
        self._process.kill()
        self._process.wait()

    def close(self) -> None:
        if self.alive:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=SERVER_GRACE)
            except subprocess.TimeoutExpired:
                self._process.kill()


class Running:
    """A worker the fork server has started: `finished` once its process tree has ended."""

    def __init__(self, server: ForkServer, ident: str, event: threading.Event, box: list, work: Path,
                 limits: Limits, uid: int | None):
        self._server, self._ident, self._event, self._box = server, ident, event, box
        self._work, self._limits, self._uid = work, limits, uid

    @property
    def finished(self) -> bool:
        return self._event.is_set()

    def kill(self) -> None:
        self._server._send({"kill": self._ident})

    def watch_cost(self, phase: str, memory: bool = True) -> dict:
        """`start`, then `stop`: what its processes spent in between, measured by the fork server
        (`cost.CostWatch`): `growth_bytes` of peak memory (with `memory`), `cpu_seconds`, and how
        many processes `ended` or `started` meanwhile; or `error`, where it could not be measured."""
        return self._server._ask({"cost": phase, "job": self._ident, "memory": memory})

    def wait(self) -> ProcessOutcome:
        """How it ended; stopped if it is still running past the wall-clock limit (and a grace)."""
        try:
            if not self._event.wait(self._limits.wall_seconds + SERVER_GRACE):
                self.kill()
                self._event.wait(SERVER_GRACE)
            if not self._box:
                if not self._server.alive:
                    raise ForkServerError(f"the fork server stopped: {self._server._stderr_tail()}")
                reply = {"returncode": None, "note": "the fork server did not answer in time"}
            else:
                reply = self._box[0]
        finally:
            if self._uid is not None:
                self._server._uids.give_back(self._uid)
                self._uid = None
        return ProcessOutcome(reply.get("returncode"), read_tail(self._work / "output.txt"),
                              reply.get("isolation", ""), reply.get("note", ""), reply.get("cpu_seconds"))


def available_isolation() -> str:
    """`namespaces`, `userns` or `session`: what the fork server will manage here (server.py), found by
    a short-lived process that tries; `session` means submissions are not isolated."""
    found = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "from autograde.sandbox.isolation import available; print(available())", str(ROOT)],
                           capture_output=True, text=True, cwd="/")
    return found.stdout.strip() or "session"


_shared: ForkServer | None = None
_shared_lock = threading.Lock()
_zygote_requests: socket.socket | None = None  # where this process's fork server is forked, if anywhere


def start_zygote() -> Zygote | None:
    """Start the run's zygote, and fork this process's server there; it is closed at exit, after
    that server. None where a server forked there could not be watched from here (no pidfd: Linux
    before 5.3) or the zygote could not start: servers are then started alone."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        zygote = Zygote()
    except (AttributeError, OSError):
        return None
    atexit.register(zygote.close)  # registered before any server's close, so it runs after them
    use_zygote(zygote.requests)
    return zygote


def zygote_load_servers() -> None:
    """Tell the run's zygote the exercises' variables as soon as this process knows them (it has
    imported the exercises), so that it loads the fork servers' modules beside this process's other
    imports rather than at the first server's request."""
    if _zygote_requests is not None:
        with contextlib.suppress(OSError):  # a zygote that has gone is met at the first request
            _zygote_requests.send(json.dumps(_exercise_variables()).encode())


def zygote_requests() -> socket.socket | None:
    return _zygote_requests


def use_zygote(requests: socket.socket | None) -> None:
    """Fork this process's fork server from the zygote whose socket `requests` is (a grading process
    is given it by the run); None: start it alone."""
    global _zygote_requests
    _zygote_requests = requests


def fork_server() -> ForkServer:
    """This process's fork server, started on first use and again if it has stopped."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = ForkServer()
            atexit.register(_shared.close)
        return _shared


def close_fork_server() -> None:
    """Stop this process's fork server, if it has one, as at exit: its requests closed, then waited for."""
    with _shared_lock:
        if _shared is not None:
            _shared.close()


def stop_fork_server() -> None:
    with _shared_lock:
        if _shared is not None:
            _shared.kill()
