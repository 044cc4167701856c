"""What the kernel's /proc says of a process, read by the fork server from outside the submission
(and by a learner's kernel of itself): resident sizes and their peak, the pages it touched, its CPU
time, and the processes below it."""

from __future__ import annotations

import os
import time
from pathlib import Path


def status_kib(pid: int | str, field: str) -> int | None:
    """A field in kB of /proc/<pid>/status (VmRSS, VmHWM); None where there is none: the process
    has ended (a zombie has no memory fields), or this system has no /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_memory(pid: int | str) -> None:
    """Reset the peak resident size the kernel keeps for `pid` (VmHWM) to what it holds now, and
    clear the referenced bit of each of its pages, so that `referenced_writable_kib` counts the
    pages it reads or writes from now on."""
    clear_refs = Path(f"/proc/{pid}/clear_refs")
    clear_refs.write_text("1")
    clear_refs.write_text("5")


def referenced_writable_kib(pid: int | str) -> int:
    """The memory of `pid` read or written since `reset_peak_memory` where a buffer held from
    before a call could be written, in kB: the Referenced lines of /proc/<pid>/smaps over its
    writable mappings (heap, shared memory, writable files) and its anonymous ones, whatever their
    permissions now (a buffer made read-only once written)."""
    total, counted = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            name, _, rest = line.partition(" ")
            if not name.endswith(":"):  # a mapping's first line: address range, permissions, offset, device, inode
                permissions, _, _, inode = rest.split(maxsplit=4)[:4]
                counted = "w" in permissions or inode == "0"
            elif name == "Referenced:" and counted:
                total += int(rest.split()[0])
    return total


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """The CPU time of `pid` (utime + stime in /proc/<pid>/stat: all its threads, ended ones too)
    and of the children it has reaped (cutime + cstime), in ticks; None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
    except (OSError, IndexError, ValueError):
        return None


def cpu_clock_ns(pid: int) -> int | None:
    """The CPU time of `pid` in nanoseconds, every thread of it counted, ended ones too: its process
    CPU-time clock (clock_getcpuclockid(3), which Linux lets any process read of another), where
    `cpu_ticks` counts in ticks of 10 ms; None once it has gone."""
    try:
        return time.clock_gettime_ns(~pid << 3 | 2)  # the kernel's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        return None


def children(parent: int | None = None) -> list[int]:
    """The children of `parent` (by default this process), those of any of its threads."""
    parent = os.getpid() if parent is None else parent
    try:
        return [int(pid) for task in Path(f"/proc/{parent}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    except FileNotFoundError:
        if not Path(f"/proc/{parent}").exists():  # it has ended
            return []
    except OSError:
        pass
    found = []  # a kernel without those files: look for them
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def descendants(parent: int) -> list[int]:
    """Every process below `parent`: its children, theirs, and so on."""
    found, waiting = [], children(parent)
    while waiting:
        pid = waiting.pop()
        found.append(pid)
        waiting += children(pid)
    return found
