"""Linux isolation for one submission: namespaces, a private root filesystem, an unprivileged uid,
a syscall filter.

Python 3.11 has no `os.unshare` or mount calls, so these are the C library's, through ctypes.
They are called in processes forked from the warm fork server, with no exec in between; a
sandboxing tool that starts a new program (bubblewrap, nsjail) would lose the imported torch,
which is what makes a warm fork cheap.
`private_root` builds, in a new mount namespace, a root filesystem that holds only what the
worker needs: the system's libraries, the Python installation, the virtual environment, the
`autograde` package and the submission's scratch folder, read-only except the scratch folder.
Everything else (other students' notebooks, the solutions, the grade report, the home folders)
is not there. A submission's cgroup is `cgroups.py`'s; what /proc says of its processes, `procfs.py`'s.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWCGROUP = 0x20000000, 0x40000000, 0x10000000, 0x02000000
# The supervisor enters these; the submission's first process then a mount namespace of its
# own, so that its new root does not become the supervisor's too.
NAMESPACES = CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
ST_FLAGS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers; glibc has no wrapper

SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom")
# A CUDA GPU's device nodes (/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm, ...): only in the
# root of a worker whose exercise runs kernels on the GPU (Exercise.gpu). Its memory is beyond
# the cgroup's reach, which is why every other worker does without it (THREAT_MODEL.md, "GPUs").
GPU_DEVICE_PREFIX = "nvidia"
# Where such a worker finds the CUDA driver's library (bound from where the grader found it), under
# both names Triton may link it by; its TRITON_LIBCUDA_PATH names this folder.
DRIVER_FOLDER = "/run/cuda-driver"
DRIVER_NAMES = ("libcuda.so.1", "libcuda.so")

_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(OSError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise IsolationError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def unmount(target: str) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH)), f"umount {target}")


def scratch_tmpfs(folder: str, size: int, files: int) -> None:
    """A tmpfs of `size` bytes and `files` inodes on `folder`, in this process's mount namespace."""
    mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={files},mode=0755")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), "prctl")


def thread_names() -> list[str]:
    """The names of this process's threads (Linux's /proc; OSError elsewhere). A process that forks
    holding more than one copies, half-way, whatever the others hold: a lock, an OpenMP team."""
    tasks = Path("/proc/self/task")
    return [(tasks / tid / "comm").read_text().strip() for tid in os.listdir(tasks)]


def die_with_parent() -> None:
    prctl(PR_SET_PDEATHSIG, 9)


def adopt_orphans() -> None:
    """Descendants whose parent dies become this process's children: it can wait for all of them."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def no_new_privileges() -> None:
    """Set-user-ID programs and file capabilities give nothing from here on."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def pivot_root(new_root: str, put_old: str) -> None:
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise IsolationError(0, f"pivot_root: no syscall number known for {os.uname().machine}")
    _check(_libc.syscall(ctypes.c_long(number), new_root.encode(), put_old.encode()), "pivot_root")


def enter_user_namespace(namespaces: int) -> None:
    """Enter a new user namespace and, owned by it, the `namespaces`; no privilege needed.

    The caller's uid and gid map to themselves, one each: inside, it is the same user, with every
    capability over the new namespaces (mounts in its own mount namespace, say) and none outside.
    `setgroups` is refused inside, as the kernel requires before an unprivileged gid map.
    """
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | namespaces)
    write_id_maps("self", {uid: uid}, {gid: gid}, deny_setgroups=True)


def user_namespaces_work() -> bool:
    """Whether this process may enter a user namespace, with the others and a mount in it (tried in
    a child: the kernel, a sysctl or a seccomp profile may refuse)."""
    child = os.fork()
    if child == 0:
        try:
            enter_user_namespace(NAMESPACES | CLONE_NEWNS)
            mount("tmpfs", "/tmp", "tmpfs", 0, "size=4k")
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(child, 0)[1] == 0


# The settings that refuse user namespaces to a user without privileges: (file, refusing value, name).
USER_NAMESPACE_SETTINGS = (
    ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
     "AppArmor (kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu's default since 23.10)"),
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "the sysctl kernel.unprivileged_userns_clone=0"),
    ("/proc/sys/user/max_user_namespaces", "0", "the sysctl user.max_user_namespaces=0"),
)


def user_namespaces_refusal() -> str:
    """A sentence naming what refuses user namespaces here, where a setting says so."""
    named = []
    for path, refusing, name in USER_NAMESPACE_SETTINGS:
        try:
            if Path(path).read_text().strip() == refusing:
                named.append(name)
        except OSError:
            continue
    if named:
        return f"User namespaces are refused here by {' and '.join(named)}"
    return ("No sysctl refuses user namespaces here, so a seccomp profile (a container's default one refuses "
            "unshare) or another security module does")


def available() -> str:
    """How a submission would be isolated here: `namespaces`, `userns` or `session` (see server.py)."""
    if os.getuid() == 0:
        child = os.fork()
        if child == 0:
            try:
                unshare(NAMESPACES | CLONE_NEWNS)
                os._exit(0)
            except BaseException:
                os._exit(1)
        if os.waitpid(child, 0)[1] == 0:
            return "namespaces"
    return "userns" if user_namespaces_work() else "session"


def write_id_maps(pid: int | str, uids: dict[int, int], gids: dict[int, int], deny_setgroups: bool = False) -> None:
    """Map ids inside the user namespace of `pid` to ids outside, one by one (inside: outside).

    Only the caller's own ids, unless the caller has CAP_SETUID and CAP_SETGID outside: then, as
    root, the process in the namespace can be root (to build the private root) and the
    submission's uid (to run it), with nothing else mapped."""
    settings = [("uid_map", uids), ("gid_map", gids)]
    if deny_setgroups:
        settings.insert(0, ("setgroups", None))
    for name, ids in settings:
        with open(f"/proc/{pid}/{name}", "w") as file:
            file.write("deny" if ids is None else "".join(f"{inside} {outside} 1\n" for inside, outside in ids.items()))


def drop_capabilities(uid: int | None = None) -> None:
    """None left, for good: the bounding set, ambient, inheritable, permitted and effective; as
    root in a user namespace, becoming `uid` on the way (which needs CAP_SETUID, so comes between).

    Inside a user namespace the capabilities are over that namespace only, but they would let the
    submission remount its read-only folders writable; without root, its uid is the grader's own.
    """
    for capability in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(capability), 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability this kernel knows
                break
            _check(-1, "drop the bounding set")
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if uid is not None:
        drop_privileges(uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def _remount(target: Path, flags: int) -> None:
    """Remount `target` with `flags` added to those it has: a mount copied into a user namespace
    keeps its read-only, nosuid, nodev and noexec flags locked, and a remount without them fails."""
    have = os.statvfs(target).f_flag
    kept = 0
    for st_flag, ms_flag in ST_FLAGS.items():
        if have & st_flag:
            kept |= ms_flag
    mount(None, str(target), None, MS_REMOUNT | MS_BIND | kept | flags)


def _read_only_bind(source: str, target: Path, extra: int = MS_NOSUID | MS_NODEV, recursive: bool = False) -> None:
    try:
        mount(source, str(target), None, MS_BIND | (MS_REC if recursive else 0))
    except IsolationError as exc:
        if exc.errno != 22:
            raise
        # In a user namespace, a folder with mounts below it (/sys, or /etc in a container) binds
        # only with them: they cannot be left out, which would reveal what lies under them.
        mount(source, str(target), None, MS_BIND | MS_REC)
    _remount(target, MS_RDONLY | extra)


def _place(new_root: Path, path: str, is_dir: bool) -> Path:
    target = new_root / path.lstrip("/")
    if is_dir:
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    return target


def python_folders(package_root: Path) -> list[str]:
    """What the interpreter reads: its installation, its environment, its import path.

    The folder holding the `autograde` package is replaced by the package itself, so that the
    course's solutions next to it stay out of sight.
    """
    folders = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix}
    folders.update(p for p in sys.path if p and os.path.isdir(p))
    folders.discard(str(package_root))
    folders.add(str(package_root / "autograde"))
    return sorted(f for f in folders if not any(f != o and f.startswith(o + os.sep) for o in folders))


def gpu_nodes() -> tuple[str, ...]:
    """The machine's CUDA GPU device nodes under /dev (none on a machine without one)."""
    return tuple(sorted(name for name in os.listdir("/dev") if name.startswith(GPU_DEVICE_PREFIX)))


def gets_gpu(asked: bool) -> bool:
    """Whether a worker whose exercise asks for the GPU (`asked`) has one: the machine must have it."""
    return asked and bool(gpu_nodes())


def device_nodes(gpu: bool) -> tuple[str, ...]:
    """The names under /dev that a worker's root holds: a few harmless ones, and the GPU's if
    its exercise needs the GPU and the machine has one."""
    return DEVICES + (gpu_nodes() if gpu else ())


def proc_flags(gpu: bool) -> int:
    """How a worker's /proc is mounted: read-only, since a process that made itself dumpable again
    could otherwise reset its own peak memory and referenced pages (/proc/self/clear_refs), which
    the fork server measures; writable for a worker with the GPU, whose CUDA initialisation fails
    on a read-only /proc ("Error 304: OS call failed", on an H100) and whose exercise measures no
    memory from outside."""
    return MS_NOSUID | MS_NODEV | MS_NOEXEC | (0 if gets_gpu(gpu) else MS_RDONLY)


def private_root(new_root: Path, scratch: Path, package_root: Path, gpu: bool = False,
                 driver: str | None = None) -> None:
    """Make `new_root` (an empty folder) this mount namespace's root, as described above; with
    the GPU's device nodes only if `gpu`, and the file `driver` (the CUDA driver's library) in
    `DRIVER_FOLDER` where given.

    Run in a new PID namespace, as root or in a user namespace of its own, before dropping
    privileges; it enters a new mount namespace.
    """
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", str(new_root), "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for folder in SYSTEM_FOLDERS:
        if os.path.islink(folder):  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(folder), new_root / folder.lstrip("/"))
        elif os.path.isdir(folder):
            # With the GPU, with the mounts below them: the driver's libraries are often a mount of
            # their own (/usr/local/nvidia on a cloud VM; file by file in a GPU container). Never
            # /sys's (cgroups, debugfs), which the remount to read-only would not reach.
            _read_only_bind(folder, _place(new_root, folder, True), recursive=gpu and folder != "/sys")
    for folder in python_folders(package_root):
        _read_only_bind(folder, _place(new_root, folder, True))
    dev = _place(new_root, "/dev", True)
    mount("tmpfs", str(dev), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in device_nodes(gpu):
        if os.path.exists(f"/dev/{name}"):  # a node, or a folder of them (/dev/nvidia-caps)
            mount(f"/dev/{name}", str(_place(new_root, f"/dev/{name}", os.path.isdir(f"/dev/{name}"))), None,
                  MS_BIND | MS_REC)
    if driver is not None:  # the file alone: the folders it lies in may be closed to the worker's uid
        for name in DRIVER_NAMES:
            _read_only_bind(driver, _place(new_root, f"{DRIVER_FOLDER}/{name}", False))
    shm = _place(new_root, "/dev/shm", True)
    mount("tmpfs", str(shm), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    mount(str(scratch), str(_place(new_root, str(scratch), True)), None, MS_BIND)
    _remount(new_root / str(scratch).lstrip("/"), MS_NOSUID | MS_NODEV)
    mount("proc", str(_place(new_root, "/proc", True)), "proc", proc_flags(gpu))
    old = _place(new_root, "/.old-root", True)
    pivot_root(str(new_root), str(old))
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.rmdir("/.old-root")
    _remount(Path("/"), MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(uid: int) -> None:
    """Become `uid` (with the same gid) with no supplementary groups; there is no way back."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
