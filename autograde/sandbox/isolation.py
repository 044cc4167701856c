"""Linux isolation for one submission: namespaces, a private root filesystem, an unprivileged uid.

Python 3.11 has no `os.unshare` or mount calls, so these are the C library's, through ctypes.
`private_root` builds, in a new mount namespace, a root filesystem that holds only what the
worker needs: the system's libraries, the Python installation, the virtual environment, the
`autograde` package and the submission's scratch folder, read-only except the scratch folder.
Everything else (other students' notebooks, the solutions, the grade report, the home folders)
is not there.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
# The supervisor enters these; the submission's first process then a mount namespace of its
# own, so that its new root does not become the supervisor's too.
NAMESPACES = CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers; glibc has no wrapper

SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom")

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
    """A tmpfs of `size` bytes and `files` inodes on `folder`, in this (the grader's) mount namespace."""
    mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={files},mode=0755")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), "prctl")


def die_with_parent() -> None:
    prctl(PR_SET_PDEATHSIG, 9)


def no_new_privileges() -> None:
    """Set-user-ID programs and file capabilities give nothing from here on."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def pivot_root(new_root: str, put_old: str) -> None:
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise IsolationError(0, f"pivot_root: no syscall number known for {os.uname().machine}")
    _check(_libc.syscall(ctypes.c_long(number), new_root.encode(), put_old.encode()), "pivot_root")


def _read_only_bind(source: str, target: Path, extra: int = MS_NOSUID | MS_NODEV) -> None:
    mount(source, str(target), None, MS_BIND)
    mount(None, str(target), None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)


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


def private_root(new_root: Path, scratch: Path, package_root: Path) -> None:
    """Make `new_root` (an empty folder) this mount namespace's root, as described above.

    Run as root in a new PID namespace, before dropping privileges; it enters a new mount namespace.
    """
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", str(new_root), "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for folder in SYSTEM_FOLDERS:
        if os.path.islink(folder):  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(folder), new_root / folder.lstrip("/"))
        elif os.path.isdir(folder):
            _read_only_bind(folder, _place(new_root, folder, True))
    for folder in python_folders(package_root):
        _read_only_bind(folder, _place(new_root, folder, True))
    dev = _place(new_root, "/dev", True)
    mount("tmpfs", str(dev), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES + tuple(n for n in os.listdir("/dev") if n.startswith("nvidia")):
        if os.path.exists(f"/dev/{name}"):
            mount(f"/dev/{name}", str(_place(new_root, f"/dev/{name}", False)), None, MS_BIND)
    shm = _place(new_root, "/dev/shm", True)
    mount("tmpfs", str(shm), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    mount(str(scratch), str(_place(new_root, str(scratch), True)), None, MS_BIND)
    mount(None, str(new_root / str(scratch).lstrip("/")), None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    mount("proc", str(_place(new_root, "/proc", True)), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    old = _place(new_root, "/.old-root", True)
    pivot_root(str(new_root), str(old))
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.rmdir("/.old-root")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(uid: int) -> None:
    """Become `uid` (with the same gid) with no supplementary groups; there is no way back."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


CGROUPS = Path("/sys/fs/cgroup")


class Cgroup:
    """A control group for one submission's process tree: its memory, processes and CPU together.

    Limits per process (rlimits) do not bound a tree: 64 processes may each fill their address
    space. A cgroup does, and it lists every process of the tree, wherever it went. Version 2
    (one hierarchy) or version 1 (one per controller); creating one raises OSError where the
    grader may not (without root, or in a container that does not delegate them).
    """

    PERIOD = 100_000  # microseconds of the CPU quota's period

    def __init__(self, name: str, memory_bytes: int, processes: int, cpus: float):
        quota = int(cpus * self.PERIOD)
        if (CGROUPS / "cgroup.controllers").exists():
            wanted = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": processes,
                      "cpu.max": f"{quota} {self.PERIOD}"}
            self.folders = [CGROUPS / name]
            self._create({self.folders[0]: wanted})
        else:
            wanted_by_controller = {
                "memory": {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes},
                "pids": {"pids.max": processes},
                "cpu": {"cpu.cfs_period_us": self.PERIOD, "cpu.cfs_quota_us": quota},
            }
            self.folders = [CGROUPS / controller / name for controller in wanted_by_controller]
            self._create(dict(zip(self.folders, wanted_by_controller.values())))

    def _create(self, settings: dict[Path, dict]) -> None:
        try:
            for folder, values in settings.items():
                folder.mkdir()
                for key, value in values.items():
                    try:
                        (folder / key).write_text(str(value))
                    except OSError:
                        if "swap" not in key and "memsw" not in key:  # without swap accounting, no swap limit
                            raise
        except OSError:
            self.remove()
            raise

    def join(self) -> None:
        """Put the calling process in the group; its children will be born in it."""
        for folder in self.folders:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def processes(self) -> set[int]:
        found = set()
        for folder in self.folders:
            try:
                found.update(int(pid) for pid in (folder / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return found

    def remove(self) -> None:
        """Once its processes have gone (the caller killed them), the group goes too."""
        for folder in self.folders:
            for _ in range(200):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still busy: its last processes are being reaped
                    time.sleep(0.01)
