"""What one call cost a submission's processes, measured by the fork server from outside them
(`cost` requests): the memory they gained and touched, and their CPU time."""

from __future__ import annotations

import os

from autograde.sandbox import procfs


class CostWatch:
    """What one call cost a job's processes, measured from here, outside them: their peak memory
    and their CPU time.

    `begin`: for every process of the job (each descendant of its supervisor), the peak resident
    size the kernel keeps (VmHWM) is reset to what it holds now, the referenced bits of its pages
    cleared, and its CPU time read (its CPU-time clock: every thread, to the nanosecond). `end`:
    how far each peak rose above that, the writable memory each read or wrote (a buffer held from
    before the call raises no peak), and the CPU time spent, each summed; and whether a process
    started or ended meanwhile, which would take its memory and time out of the sums: a process
    that is there at the end but not at the start, one that is gone, or a child reaped in between
    (the CPU time of reaped children grew; a process doing the work of a call runs for more than a
    tick). Honest code starts no process during a call.

    `memory=False`: the CPU time alone. Clearing and reading every page's referenced bit costs tens
    of milliseconds a process, which a case timing several calls need not pay."""

    def __init__(self, supervisor: int, memory: bool = True):
        self.supervisor, self.memory = supervisor, memory
        # pid -> (resident kB, CPU ticks (its own, its reaped children's), CPU nanoseconds)
        self.start: dict[int, tuple[int, tuple[int, int], int | None]] = {}

    def begin(self) -> None:
        for pid in procfs.descendants(self.supervisor):
            if self.memory:
                procfs.reset_peak_memory(pid)
            resident, ticks = procfs.status_kib(pid, "VmRSS"), procfs.cpu_ticks(pid)
            if resident is not None and ticks is not None:
                self.start[pid] = (resident, ticks, procfs.cpu_clock_ns(pid))

    def end(self) -> dict:
        growth, referenced, seconds, ended = 0, 0, 0.0, 0
        for pid, (resident, (own, children), clock) in self.start.items():
            peak, now, clock_now = procfs.status_kib(pid, "VmHWM"), procfs.cpu_ticks(pid), procfs.cpu_clock_ns(pid)
            if peak is None or now is None or now[1] != children:
                ended += 1
                continue
            if self.memory:
                growth += max(0, peak - resident)
                referenced += procfs.referenced_writable_kib(pid)
            # The clock, to the nanosecond: a call of 0.1 s in ticks would be off by up to two fifths
            # (each reading truncates user and system time), enough to pass as half its cost.
            exact = clock is not None and clock_now is not None
            seconds += (clock_now - clock) / 1e9 if exact else (now[0] - own) / os.sysconf("SC_CLK_TCK")
        started = len(set(procfs.descendants(self.supervisor)) - set(self.start))
        return {"growth_bytes": growth * 1024, "referenced_bytes": referenced * 1024,
                "cpu_seconds": seconds, "ended": ended, "started": started}


def watch(request: dict, running: dict[int, tuple[str, int]], watches: dict[str, CostWatch]) -> dict:
    """A `cost` request (`start` or `stop`) for the job `request["job"]`; `memory: false` with `start`:
    the CPU time alone."""
    job = request["job"]
    try:
        if request["cost"] == "start":
            supervisor = next((pid for pid, (ident, _) in running.items() if ident == job), None)
            if supervisor is None:
                return {"error": "its processes have ended"}
            watches[job] = CostWatch(supervisor, memory=request.get("memory", True))
            watches[job].begin()
            return {"watching": len(watches[job].start)}
        if job not in watches:
            return {"error": "it was not being measured"}
        return watches.pop(job).end()
    except OSError as exc:  # a process the grader may not measure (one that made itself undumpable, say)
        watches.pop(job, None)
        return {"error": str(exc)}
