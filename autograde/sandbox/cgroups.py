"""A submission's control group: its memory, process and CPU limits, and the group a run's own
groups are made in (the one a job scheduler or systemd delegated, or the machine's as root)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup")


REQUIRED_CONTROLLERS = ("memory", "pids")  # in a submission's version-2 group; and cpu, where offered
REST = "autograde-rest"  # the delegated group's own processes, moved out of its way
# "1" where the instructor declares the group the run started in delegated (`grade --delegated-cgroup`)
DELEGATED_VARIABLE = "AUTOGRADE_DELEGATED_CGROUP"


def hand_down_controllers(group: Path) -> None:
    """Enable the required controllers and cpu, those `group` (version 2) has, in its children's
    groups: at boot without systemd, even the root group hands down none. Raises OSError where the
    kernel refuses: a group other than the root that still holds processes may not."""
    offered = (group / "cgroup.controllers").read_text().split()
    wanted = [name for name in (*REQUIRED_CONTROLLERS, "cpu") if name in offered]
    (group / "cgroup.subtree_control").write_text(" ".join(f"+{name}" for name in wanted))


def marked_delegated(group: Path) -> bool:
    """Whether `group` was handed over as systemd's system manager marks it (`Delegate=yes`): the
    `trusted.delegate` or (readable without privileges) `user.delegate` extended attribute set to 1.
    Every other group belongs to its manager, even one whose files belong to the user (the user
    manager's own scopes, which it never marks, delegated or not: `declared` below), and making
    groups in those would step on its toes."""
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(group, name) == b"1":
                return True
        except OSError:
            pass
    return False


def delegated_cgroup(declared: bool = False) -> tuple[Path | None, str]:
    """The control group delegated to this process's user, and why not where there is none: version
    2, this process's own group (or its parent, if a fork server before this one moved it into
    `REST`), marked as delegated or `declared` so by the instructor (`grade --delegated-cgroup`),
    writable by this uid, with the memory and pids controllers."""
    if not (CGROUPS / "cgroup.controllers").exists():
        return None, "cgroup v1: no group is delegated to a user"
    try:
        entry = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
        own = CGROUPS / entry[3:].strip("/")
        if own.name == REST:
            own = own.parent
        offered = set((own / "cgroup.controllers").read_text().split())
    except (OSError, StopIteration) as exc:
        return None, f"this process's group cannot be read ({exc})"
    if not (declared or marked_delegated(own)):
        return None, f"{own} is not marked as delegated (grade --delegated-cgroup says it is)"
    if not all(os.access(own / name, os.W_OK) for name in ("", "cgroup.procs", "cgroup.subtree_control")):
        return None, f"{own} is not writable by uid {os.getuid()}: not delegated to this user"
    if not set(REQUIRED_CONTROLLERS) <= offered:
        return None, f"{own} offers the controllers {' '.join(sorted(offered)) or 'none'}, not memory and pids"
    return own, ""


def take_delegated_cgroup(declared: bool = False) -> tuple[Path | None, str]:
    """Make the delegated group (`delegated_cgroup`) ready for one group per submission: a group
    may hand controllers to its children only while it holds no process itself, so its processes
    (this one, the grader, whatever else ran there) move into a child, `REST`, first. Returns the
    group, or None and why."""
    own, why = delegated_cgroup(declared)
    if own is None:
        return None, why
    try:
        (own / REST).mkdir(exist_ok=True)
        for _ in range(20):  # a process may start beside them while they move: again
            for pid in (own / "cgroup.procs").read_text().split():
                try:
                    (own / REST / "cgroup.procs").write_text(pid)
                except ProcessLookupError:
                    pass
            try:
                hand_down_controllers(own)
                return own, ""
            except OSError as exc:
                why = f"{own} would not hand its controllers down ({exc})"
                time.sleep(0.01)
    except OSError as exc:
        why = f"{own}: {exc}"
    return None, why


class Cgroup:
    """A control group for one submission's process tree: its memory, processes and CPU together.

    Limits per process (rlimits) do not bound a tree: 64 processes may each fill their address
    space. A cgroup does, and it lists every process of the tree, wherever it went. Version 2
    (one hierarchy) or version 1 (one per controller); creating one raises OSError where the
    grader may not (without root, or in a container that does not delegate them).
    """

    PERIOD = 100_000  # microseconds of the CPU quota's period

    def __init__(self, name: str, memory_bytes: int, processes: int, cpus: float, parents: dict[str, Path]):
        """`parents`: where to make it (`submission_cgroup_parents`): {"": a version-2 group}, or
        a version-1 group per controller."""
        quota = int(cpus * self.PERIOD)
        if "" in parents:
            within = parents[""]
            wanted = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": processes}
            if "cpu" in (within / "cgroup.subtree_control").read_text().split():  # memory and pids are a must
                wanted["cpu.max"] = f"{quota} {self.PERIOD}"
            settings = {within / name: wanted}
        else:
            wanted_by_controller = {
                "memory": {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes},
                "pids": {"pids.max": processes},
                "cpu": {"cpu.cfs_period_us": self.PERIOD, "cpu.cfs_quota_us": quota},
            }
            settings = {}
            for controller, values in wanted_by_controller.items():
                if controller in parents:  # cpu where it is mounted; memory and pids always (see there)
                    settings.setdefault(parents[controller] / name, {}).update(values)
        self.folders = list(settings)
        self._create(settings)

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
            _remove_group(folder)


def _remove_group(folder: Path, tries: int = 200) -> bool:
    """rmdir `folder`, a group whose processes are being killed and reaped: again while it is busy."""
    for _ in range(tries):
        try:
            folder.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # still busy: its last processes are being reaped
            time.sleep(0.01)
    return False


# A submission's group: autograde-<the fork server's pid>-<its supervisor's pid> (before, autograde-<supervisor>).
_SUBMISSION_GROUP = re.compile(r"autograde-(\d+)(?:-\d+)?")
V1_CONTROLLERS = ("memory", "pids", "cpu")  # the version-1 hierarchies a submission's group is made in


def _cgroup_mounts() -> list[tuple[str, Path, str, set[str]]]:
    """Every cgroup hierarchy mounted here: (the folder of the hierarchy it shows, where, its type,
    its options: a version-1 hierarchy's controllers)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        fields, rest = fields.split(), rest.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], Path(fields[4]), rest[0], set(rest[2].split(","))))
    return found


def _mounted_at(path: str, shown: str, mount_point: Path) -> Path | None:
    """Where the group `path` of a hierarchy lies, under a mount of its folder `shown`; None if it
    lies outside (a container that sees only part of the hierarchy)."""
    relative = os.path.relpath(path, shown)
    if relative == ".." or relative.startswith("../"):
        return None
    return mount_point if relative == "." else mount_point / relative


def own_cgroups() -> dict[str, Path]:
    """The groups this process runs in, where they are mounted: {"": its group} under version 2,
    else {controller: its group in that controller's hierarchy} for the `V1_CONTROLLERS` mounted."""
    lines = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    version_2 = (CGROUPS / "cgroup.controllers").exists()
    found: dict[str, Path] = {}
    for shown, mount_point, kind, options in _cgroup_mounts():
        for _, controllers, path in lines:
            if version_2 and kind == "cgroup2" and mount_point == CGROUPS and controllers == "":
                names = [""]
            elif not version_2 and kind == "cgroup":
                names = [c for c in controllers.split(",") if c in V1_CONTROLLERS and c in options]
            else:
                continue
            where = _mounted_at(path, shown, mount_point)
            for name in names:
                if where is not None and name not in found:
                    found[name] = where
    return found


def submission_cgroup_parents() -> tuple[dict[str, Path] | None, str]:
    """As root: where the submissions' groups go, and why nowhere where they cannot. Inside the
    groups this process runs in, as systemd and Slurm delegate them, so that a job's limits bound
    its notebooks too. Under version 2, a group other than the root must first hand down its
    controllers, which it may only while it holds no process: its processes move into `REST`, as
    with a group delegated without root (`take_delegated_cgroup`)."""
    try:
        own = own_cgroups()
    except OSError as exc:
        return None, f"this process's groups cannot be read ({exc})"
    if "" in own:
        if own[""] != CGROUPS:
            group, why = take_delegated_cgroup(declared=True)
            return ({"": group}, "") if group is not None else (None, why)
        try:  # the root group: at boot without systemd it hands down no controller
            enabled = (CGROUPS / "cgroup.subtree_control").read_text().split()
            if not set(REQUIRED_CONTROLLERS) <= set(enabled):
                hand_down_controllers(CGROUPS)
        except OSError as exc:
            return None, f"{CGROUPS} would not hand its controllers down ({exc})"
        return {"": CGROUPS}, ""
    missing = [name for name in REQUIRED_CONTROLLERS if name not in own]
    if missing:
        return None, f"no cgroup hierarchy of {' or '.join(missing)} is mounted where this process's group is"
    return own, ""


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_submission_groups(parents: dict[str, Path], server: int | None = None) -> None:
    """Remove the submissions' groups in `parents`: those of the fork server `server`, as it stops,
    killing whatever is left in them; by default those whose fork server has gone, which a grader
    killed with SIGKILL leaves behind, where they are empty (a group that still holds a process may
    belong to a run this process cannot see)."""
    for parent in set(parents.values()):
        try:
            children = [child for child in parent.iterdir() if child.is_dir()]
        except OSError:
            continue
        for folder in children:
            match = _SUBMISSION_GROUP.fullmatch(folder.name)
            if match is None:
                continue
            owner = int(match.group(1))
            if server is None:
                if not _running(owner):
                    _remove_group(folder, tries=1)
            elif owner == server:
                for _ in range(100):
                    try:
                        left = [int(pid) for pid in (folder / "cgroup.procs").read_text().split()]
                    except OSError:
                        break
                    for pid in left:
                        try:
                            os.kill(pid, 9)
                        except OSError:
                            pass
                    if _remove_group(folder, tries=1):
                        break
                    time.sleep(0.01)
