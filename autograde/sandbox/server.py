"""A warm interpreter that forks one isolated process tree per submission.

Started by each grading process's `sandbox.ForkServer`, alone or forked from the run's zygote
(`zygote.py`, which has imported this module), it imports torch, numpy, triton and the
grader's worker, and nothing of any submission. Each request (a JSON line on stdin) forks a
*supervisor*, which isolates the submission in one of three ways (the reply says which):

- `namespaces`, as root with CAP_SYS_ADMIN: the supervisor makes a cgroup, enters new
  namespaces and forks the first process of a new PID namespace, the *submission's process*:
  it joins the cgroup, makes a private root filesystem (`isolation.private_root`), and runs
  `worker.main` under an unprivileged uid with resource limits;
- `userns`, without root or without CAP_SYS_ADMIN, where the kernel allows user namespaces: the
  supervisor forks a process that joins the cgroup (as root; without root, where a group is
  delegated to the user: `cgroups.take_delegated_cgroup`), as root takes the submission's
  uid, enters a new user namespace and, owned by it, the same namespaces, and forks the first
  process of the PID namespace, the submission's process, which goes on as above but drops every
  capability instead of changing uid;
- `session`, where neither works: the submission runs in a new session with the same rlimits,
  and the supervisor kills its process group and, when it had its own uid or cgroup, every
  process of those. This isolates nothing: `client.available_isolation` lets the grader say so
  before it starts.

The server first enters a mount namespace of its own (`_own_mount_namespace`; without root, in a
user namespace of its own), where it mounts each job's scratch folder as a tmpfs of bounded size
when the grader asks (a `mount` request; `unmount` afterwards): the grader reaches it through
`/proc/<server>/root`, and each submission's root, made from a copy of this namespace, binds it.

The groups are made inside the grader's own (`cgroups.submission_cgroup_parents`), so that a
job's limits (Slurm's, a systemd unit's) bound its notebooks too, and named after the server, which
removes those of its jobs when it stops, and at its start those of servers that are gone.

The server and its supervisors ignore SIGINT, SIGTERM and SIGHUP (set before it starts, by the
client): a job scheduler sends them to every process of a job, and whether a run stops is for
the grader to decide, which then stops the server by closing its requests. The submission's
process takes the default actions back.

The grader may also ask what one call cost a job's processes, their peak memory and CPU time
(`cost` requests: `cost.CostWatch`), which the server measures from here, outside them.

In every mode the supervisor is a child subreaper: whatever the tree orphans becomes its child,
and it kills and reaps every one before it reports.

The submission's process then sets `no_new_privs` and installs the syscall filter
(`syscall_filter`), when libseccomp is there. The supervisor waits for it against the wall
clock, kills it (and with it the whole namespace), kills whatever is left in its cgroup or runs
under its uid, and writes how it ended to a pipe; the server sends that back as a JSON line on
stdout.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Imported here so that every submission process starts with them: under another uid, in a
# session (no namespaces), it may not be able to read the installation they come from.
import numpy  # noqa: F401
import numpy.random  # noqa: F401  (the worker seeds it)
import torch
import torch.utils.flop_counter  # noqa: F401
import triton  # noqa: F401

from autograde import registry
from autograde.sandbox import cgroups, cost, isolation, procfs, syscall_filter, tripwire, worker

# The modules that hold the exercises' not-allowed functions, imported here once for every worker's
# tripwire to find them in (`torch.nn.attention.flex_attention` alone took 11 ms of each worker).
for _name in {name for exercise in registry.EXERCISES.values() for name in exercise.not_allowed}:
    tripwire.resolve(_name)

# Where each submission gets a group of its own: as root, inside the groups the grader runs in
# (`cgroups.submission_cgroup_parents`); without root, the version-2 group delegated to the
# grader's user, where one is (`cgroups.take_delegated_cgroup`); None: no group.
_CGROUP_PARENTS: dict[str, Path] | None = None
_NO_CGROUP = ""  # as root, why no submission gets a group


def memory_rlimit(gpu: bool) -> int:
    """What bounds the submission's memory per process: its address space, except for a worker
    with the GPU, where CUDA reserves far more address space than it uses (about 18 GB once
    initialised, on an H100; under an address-space limit of 6 GiB it finds no GPU, "out of
    memory"): there its private writable memory (RLIMIT_DATA), which those reservations are not."""
    return resource.RLIMIT_DATA if isolation.gets_gpu(gpu) else resource.RLIMIT_AS


def _limits(limits: dict, processes: int, gpu: bool) -> None:
    # The CPU time limit is the hard one, SIGKILL: as the first process of its PID namespace the
    # submission ignores SIGXCPU (the kernel gives a namespace's first process, where it has no
    # handler, SIGKILL and SIGSTOP only). The supervisor tells a CPU-time kill by the CPU time spent.
    for which, value in (
        (resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"])),
        (memory_rlimit(gpu), (limits["memory_bytes"], limits["memory_bytes"])),
        (resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"])),
        (resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"])),
        (resource.RLIMIT_NPROC, (processes, processes)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)


def _user_processes(uid: int) -> dict[int, int]:
    """The processes of `uid`, each with its number of threads (what RLIMIT_NPROC counts)."""
    found = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            found[int(status.parent.name)] = int(fields.get("Threads", "1"))
    return found


def _use_bound_driver() -> None:
    """Point Triton at the CUDA driver's library bound in this root (`isolation.DRIVER_FOLDER`),
    and load it from there: CUDA then finds it loaded whether or not this uid may enter the
    folders it came from (the loader's search path was fixed when the fork server started)."""
    os.environ["TRITON_LIBCUDA_PATH"] = isolation.DRIVER_FOLDER
    ctypes.CDLL(f"{isolation.DRIVER_FOLDER}/{isolation.DRIVER_NAMES[0]}", mode=ctypes.RTLD_GLOBAL)


def _run_submission(request: dict, mode: str) -> None:
    """The submission's process: limit, drop privileges, run the worker. Never returns."""
    try:
        isolation.die_with_parent()
        work, uid = Path(request["work"]), request["uid"]
        os.chdir(work)
        output = os.open(work / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        if uid is not None:
            os.fchown(output, uid, uid)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        processes = request["limits"]["extra_processes"]
        if uid is None:  # the limit counts every process of the uid (in its user namespace, if it has one)
            processes += sum(_user_processes(os.getuid()).values())
        _limits(request["limits"], processes, request["gpu"])
        if mode == "userns":  # as root in the namespace, or its owner: no capability kept
            isolation.drop_capabilities(uid)
        elif uid is not None:
            isolation.drop_privileges(uid)
        isolation.die_with_parent()  # again: a change of uid clears it
        isolation.no_new_privileges()
        if syscall_filter.AVAILABLE:
            syscall_filter.install()
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from TMPDIR (the scratch folder), not the server's /tmp
        if request["driver"] is not None and mode != "session":
            _use_bound_driver()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        worker.main(Path("."))  # relative: its folder's parents may be closed to its uid
        sys.stdout.flush()
        os._exit(0)
    except BaseException:
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(70)


def _contain(request: dict, mode: str, group: cgroups.Cgroup | None) -> None:
    """The first process of the new PID namespace: set up the private root filesystem, then become
    the submission's process (a process less to fork and measure for every notebook). Never returns.

    When it exits, the kernel kills every other process in the namespace; orphans of its tree
    become its children, which it need not reap (they die with it, and count in its limits)."""
    try:
        isolation.die_with_parent()
        if group is not None:
            group.join()
        if mode != "session":
            isolation.private_root(Path(request["new_root"]), Path(request["work"]), Path(request["package_root"]),
                                   gpu=request["gpu"], driver=request["driver"])
        else:
            os.setsid()
    except BaseException:
        traceback.print_exc()
        os._exit(71)
    _run_submission(request, mode)


def _exit_descriptor(pid: int) -> int | None:
    """A descriptor that `select` finds readable once the child `pid` has ended (Linux 5.3 and
    later), so that its end is seen at once; None where there is none: its end is polled."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _wait(pid: int, deadline: float) -> tuple[int, resource.struct_rusage] | None:
    """The wait status of `pid` and what it and the children it reaped used, or None once the deadline passes."""
    ended = _exit_descriptor(pid)
    try:
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                return status, usage
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if ended is None:
                time.sleep(min(0.01, left))
            else:
                select.select([ended], [], [], left)
    finally:
        if ended is not None:
            os.close(ended)


def _kill_all(first: int, uid: int | None, group: cgroups.Cgroup | None) -> None:
    """Whatever the submission started, wherever it went: its cgroup's processes, its process
    group, and every process of its uid; until none is left (a fork may race a kill)."""
    try:
        os.killpg(first, signal.SIGKILL)
    except OSError:
        pass
    for _ in range(100):
        left = (group.processes() if group else set()) | (set(_user_processes(uid)) if uid is not None else set())
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _enter_user_namespace(request: dict, group: cgroups.Cgroup | None, mapped: tuple[int, int] | None) -> None:
    """Between the supervisor and the PID namespace: enter a user namespace and, owned by it, the
    others; fork their first process; end as it ends. Never returns.

    As root, it joins the cgroup first, and the supervisor, which keeps CAP_SETUID outside, maps
    root to root and the submission's uid to itself (`mapped`: a pipe to say the namespace is
    there, one to hear the maps are written); without root, its own uid maps to itself."""
    try:
        isolation.die_with_parent()
        if group is not None:
            group.join()
        if mapped is None:
            isolation.enter_user_namespace(isolation.NAMESPACES)
        else:
            isolation.unshare(isolation.CLONE_NEWUSER | isolation.NAMESPACES)
            os.write(mapped[0], b"1")
            if os.read(mapped[1], 1) != b"1":
                raise isolation.IsolationError(0, "the user namespace's ids were not mapped")
        first = os.fork()
        if first == 0:
            _contain(request, "userns", None)
        _, status = os.waitpid(first, 0)
        if os.WIFSIGNALED(status):  # the supervisor sees how the submission ended
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # its signal's end, not a core file
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status))
    except BaseException:
        traceback.print_exc()
        os._exit(71)


def _map_ids(pid: int, uid: int, pipes: tuple[int, int]) -> None:
    """The supervisor's half of `_enter_user_namespace` as root."""
    if os.read(pipes[0], 1) == b"1":
        try:
            isolation.write_id_maps(pid, {0: 0, uid: uid}, {0: 0, uid: uid})
        except OSError:
            return  # its read ends empty: it stops
        os.write(pipes[1], b"1")


def _choose_mode(notes: list[str]) -> str:
    """`namespaces` (as root), `userns`, or `session`; in the first case, already entered."""
    refused = "not root"
    if os.getuid() == 0:
        try:
            isolation.unshare(isolation.NAMESPACES)
            return "namespaces"
        except OSError as exc:
            refused = f"root, but no namespaces ({exc})"
    if isolation.user_namespaces_work():
        notes.append(f"{refused}: namespaces in a user namespace of its own")
        return "userns"
    notes.append(f"{refused}; no user namespaces either"
                 + ("" if os.getuid() == 0 else ": the same uid as the grader, no namespaces"))
    return "session"


def _supervise(request: dict, report: int) -> None:
    """The supervisor: between the server and the submission. Never returns."""
    isolation.die_with_parent()
    isolation.adopt_orphans()  # the PID namespace's first process, if its parent dies first
    os.setsid()
    uid, group, notes = request["uid"], None, []
    mode = _choose_mode(notes)
    if _CGROUP_PARENTS is not None:
        limits = request["limits"]
        try:  # named after the fork server too, which removes it if this supervisor is killed
            group = cgroups.Cgroup(f"autograde-{os.getppid()}-{os.getpid()}", limits["memory_bytes"],
                                     limits["extra_processes"] + 3, limits["cpus"], _CGROUP_PARENTS)
        except OSError as exc:
            notes.append(f"no cgroup ({exc})")
    elif _NO_CGROUP:
        notes.append(f"no cgroup ({_NO_CGROUP})")
    deadline = time.monotonic() + request["limits"]["wall_seconds"]
    mapping = (os.pipe(), os.pipe()) if mode == "userns" and os.getuid() == 0 else None
    first = os.fork()
    if first == 0:
        os.close(report)
        if mode == "userns":
            _enter_user_namespace(request, group, mapping and (mapping[0][1], mapping[1][0]))
        _contain(request, mode, group)
    if mapping:
        os.close(mapping[0][1])
        os.close(mapping[1][0])
        _map_ids(first, uid, (mapping[0][0], mapping[1][1]))
        os.close(mapping[0][0])
        os.close(mapping[1][1])
    ended = _wait(first, deadline)
    if ended is None:
        os.kill(first, signal.SIGKILL)  # as the namespace's first process (or its parent), it takes all others with it
        os.waitpid(first, 0)
    # In its own PID namespace the tree died with its first process, and its cgroup lists any
    # straggler; every process of its uid is killed only without them, since a uid may be shared
    # with another grading run on this machine.
    _kill_all(first, None if mode != "session" else uid, group)
    _kill_descendants()
    if group is not None:
        group.remove()
    kind = "+".join([mode] + ["uid"] * (uid is not None) + ["cgroup"] * bool(group)
                    + ["seccomp"] * syscall_filter.AVAILABLE)
    if not syscall_filter.AVAILABLE:
        notes.append("no syscall filter (libseccomp not found)")
    outcome = {"returncode": None, "isolation": kind}
    if ended is not None:  # the submission's end (mirrored by the user namespace's process, where there is one)
        status, usage = ended
        outcome.update(returncode=os.waitstatus_to_exitcode(status), cpu_seconds=usage.ru_utime + usage.ru_stime)
    outcome["note"] = "; ".join(notes)
    os.write(report, json.dumps(outcome).encode())
    os._exit(0)


def _kill_descendants() -> None:
    """Kill and reap every process handed to the supervisor, until none is left. As a subreaper it
    inherits whatever the submission's tree orphans (daemons included), in every mode; in a PID
    namespace, reaping its first process means the kernel has killed every other one."""
    while True:
        for pid in procfs.children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            return


def _own_mount_namespace() -> bool:
    """Enter a mount namespace of this server's own (without root, inside a user namespace of its
    own), where the machine allows it: mounts made here (the jobs' scratch folders) are seen by the
    submissions forked from here, by the grader through /proc/<server>/root (as root, or as the
    owner of that user namespace), by nobody else, and go when the server goes, however it ends.
    Root without CAP_SYS_ADMIN gets neither: a user namespace of its own would not map the
    submissions' uids."""
    if os.getuid() == 0:
        try:
            isolation.unshare(isolation.CLONE_NEWNS)
        except OSError:
            return False
    elif isolation.user_namespaces_work():
        isolation.enter_user_namespace(isolation.CLONE_NEWNS)
    else:
        return False
    isolation.mount(None, "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
    return True


def _mount(request: dict) -> dict:
    """A `mount` or `unmount` request: a job's scratch folder in this server's mount namespace."""
    try:
        if "mount" in request:
            isolation.scratch_tmpfs(request["mount"], int(request["size"]), int(request["files"]))
            return {"mounted": True}
        isolation.unmount(request["unmount"])
        return {"unmounted": True}
    except OSError as exc:
        return {"error": str(exc)}


def _prepare_cgroups() -> None:
    """Before the first job (and before this server enters a user namespace): find where the
    submissions' groups go (see `_CGROUP_PARENTS`), and remove the groups that a grader killed
    before its fork server could clean up left there."""
    global _CGROUP_PARENTS, _NO_CGROUP
    if os.getuid() != 0:  # why not, where declared, the grader said when it started (`cli.py`)
        delegated, _ = cgroups.take_delegated_cgroup(os.environ.get(cgroups.DELEGATED_VARIABLE) == "1")
        _CGROUP_PARENTS = None if delegated is None else {"": delegated}
    else:
        _CGROUP_PARENTS, _NO_CGROUP = cgroups.submission_cgroup_parents()
    if _CGROUP_PARENTS is not None:
        cgroups.remove_submission_groups(_CGROUP_PARENTS)


def _stop_every_job(running: dict[int, tuple[str, int]]) -> None:
    """As the server stops (its grader closed the requests or died): no job outlives it, and no
    group of a job either. Each supervisor's tree dies with it; what is left in its group is killed."""
    for pid in running:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in running:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    if _CGROUP_PARENTS is not None:
        cgroups.remove_submission_groups(_CGROUP_PARENTS, server=os.getpid())


def serve() -> None:
    """Read requests from stdin, answer on stdout, until stdin closes."""
    # Imported with collection off (`client.START_SERVER`, the zygote's alike): what the imports
    # made is left out of every later collection, here and in the processes forked from here.
    gc.freeze()
    gc.enable()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the replies
    torch.set_num_threads(1)
    running: dict[int, tuple[str, int]] = {}  # supervisor pid -> (request id, read end of its report)
    ends: dict[int, int | None] = {}  # supervisor pid -> its `_exit_descriptor`
    watches: dict[str, cost.CostWatch] = {}  # request id -> its call's memory, while measured
    pending = b""
    _prepare_cgroups()
    replies.write(json.dumps({"ready": os.getpid(), "mounts": _own_mount_namespace()}) + "\n")
    while True:
        # Woken by a request or by a supervisor's end (the grader waits for its report); the
        # timeout only matters where a supervisor's end cannot be selected on.
        ready, _, _ = select.select([0, *(end for end in ends.values() if end is not None)], [], [], 0.02)
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                _stop_every_job(running)
                replies.flush()
                # Everything is cleaned up: the interpreter's own teardown (torch's, triton's) would
                # keep the grader waiting for a second more.
                os._exit(0)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if "mount" in request or "unmount" in request:
                    replies.write(json.dumps({"id": request["id"], **_mount(request)}) + "\n")
                elif "cost" in request:
                    replies.write(json.dumps({"id": request["id"], **cost.watch(request, running, watches)}) + "\n")
                else:
                    _start(request, running)
        for pid in running.keys() - ends.keys():
            ends[pid] = _exit_descriptor(pid)
        _reap(running, replies)
        for pid in ends.keys() - running.keys():
            if (ended := ends.pop(pid)) is not None:
                os.close(ended)


def _start(request: dict, running: dict[int, tuple[str, int]]) -> None:
    if "kill" in request:
        for pid, (ident, _) in running.items():
            if ident == request["kill"]:
                os.kill(pid, signal.SIGKILL)
        return
    threads = isolation.thread_names()
    if len(threads) != 1:
        raise RuntimeError(f"the fork server has started a thread; forking now would be unsafe "
                           f"({', '.join(sorted(threads))})")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _supervise(request, write_end)
    os.close(write_end)
    running[pid] = (request["id"], read_end)


def _reap(running: dict[int, tuple[str, int]], replies) -> None:
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        ident, read_end = running.pop(pid)
        data = os.read(read_end, 4096)
        os.close(read_end)
        try:
            reply = json.loads(data)
        except ValueError:
            reply = {"returncode": None, "isolation": "unknown",
                     "note": f"the supervisor ended with status {status} and no report"}
        replies.write(json.dumps({"id": ident, **reply}) + "\n")
