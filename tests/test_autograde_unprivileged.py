"""The grader run by an instructor without root: each submission in a user namespace of its own.

One class is graded by `python -m autograde grade`, run as an unprivileged user (`nobody`) who
owns a copy of the course and a home folder with a mode-600 file. One student hands in the
solutions; another the solutions plus a cell that tries, from inside the sandbox, to read that
file, the solutions and a classmate's notebook, to write to the course, to connect to a TCP port
this test listens on, and to leave a daemon behind. Each finding is checked from outside too:
files unchanged, no connection accepted, no process left.

Where the kernel refuses user namespaces (as a seccomp profile does, here one installed for the
purpose), the grader refuses to grade unless told to, and says so in every grade's notes.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import nbformat
import pytest

from autograde import registry
from autograde.grading.grade import UNISOLATED_NOTE
from autograde.sandbox import cgroups, syscall_filter
from autograde.sandbox.cgroups import CGROUPS
from autograde.sandbox.client import Limits
from tests.fixtures.attacks import FILL_MEMORY_FROM_SIX_PROCESSES
from tests.fixtures.notebooks import ROOT, SEED

pytestmark = [
    pytest.mark.xdist_group("autograde_unprivileged"),  # its module's fixtures made once
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                       reason="needs root, to run the grader as another, unprivileged user, and setpriv"),
]

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
ASSIGNMENT = "attention"
# flash_forward: its memory, measured from outside the worker, by a fork server without root
EXERCISES = ("sdpa", "mha", "flash_forward")

ATTACK = """
import ctypes, errno, json, os, socket, time

def attempt(action):
    try:
        action()
        return "done"
    except OSError as exc:
        return exc.strerror

def append(path):
    with open(path, "a") as file:
        file.write("tampered")

def fill_the_scratch_folder():  # 1 GiB in files of 64 MiB (each file is bounded on its own), then many empty ones
    written, error = 0, None
    try:
        for n in range(16):
            with open(f"fill-{n}", "wb") as file:
                for _ in range(64):
                    file.write(b"x" * 2**20)
                    written += 2**20
    except OSError as exc:
        error = errno.errorcode.get(exc.errno)
    for n in range(16):
        if os.path.exists(f"fill-{n}"):
            os.remove(f"fill-{n}")
    files, files_error = 0, None
    try:
        for n in range(100_000):
            open(f"empty-{n}", "w").close()
            files += 1
    except OSError as exc:
        files_error = errno.errorcode.get(exc.errno)
    for n in range(files):
        os.remove(f"empty-{n}")
    return [written // 2**20, error, files, files_error]  # short: the finding must fit in 400 characters

found = {
    "secret": attempt(lambda: open(SECRET).read()),
    "solutions": attempt(lambda: open(COURSE + "/solutions/attention/sdpa.ipynb").read()),
    "classmate": attempt(lambda: open(CLASSMATE).read()),
    "write-solutions": attempt(lambda: append(COURSE + "/solutions/attention/sdpa.ipynb")),
    "plant-in-solutions": attempt(lambda: append(COURSE + "/solutions/planted.txt")),
    "write-grader": attempt(lambda: append(COURSE + "/autograde/__init__.py")),
    "write-classmate": attempt(lambda: append(CLASSMATE)),
    "network": attempt(lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2)),
    "fill": fill_the_scratch_folder(),
}
if os.fork() == 0:  # a daemon: new session, second fork, outlive the grading, then tamper
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, MARKER.encode(), 0, 0, 0)
        time.sleep(20)
        for path in (COURSE + "/solutions/attention/sdpa.ipynb", CLASSMATE, SECRET):
            attempt(lambda: append(path))
    os._exit(0)
time.sleep(0.3)
raise RuntimeError("FINDINGS " + json.dumps(found, separators=(",", ":")))
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def _python_for(user_command: list[str], folder: Path) -> str | None:
    """An interpreter the unprivileged user may start, with this one's packages: this one if it can
    (its fork server is started by path), else a virtual environment of a Python of the same
    version that it can, whose `.pth` file adds this environment's packages."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    probe = "import torch, numpy, nbformat"
    if _run([*user_command, "sh", "-c", f'exec "$0" -c "{probe}"', sys.executable], cwd="/").returncode == 0:
        return sys.executable
    for candidate in filter(None, (shutil.which(version, path="/usr/local/bin:/usr/bin:/bin"),)):
        environment = folder / "venv"
        if _run([candidate, "-m", "venv", "--without-pip", str(environment)]).returncode != 0:
            continue
        site = Path(sysconfig.get_paths(vars={"base": str(environment), "platbase": str(environment)})["purelib"])
        (site / "course.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        python = str(environment / "bin" / "python")
        if _run([*user_command, "sh", "-c", f'exec "$0" -c "{probe}"', python], cwd="/").returncode == 0:
            return python
    return None


def _owned_by_nobody(path: Path) -> None:
    for folder, folders, files in os.walk(path):
        os.chown(folder, NOBODY, NOBODY)
        for name in files:
            os.chown(os.path.join(folder, name), NOBODY, NOBODY)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _processes_named(name: str) -> list[int]:
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == name:
                found.append(int(comm.parent.name))
        except OSError:
            pass
    return found


class Setting:
    """An instructor's folder, owned by `nobody`: home (a secret), the course, the submissions."""

    def __init__(self, base: Path):
        base.chmod(0o755)
        self.base, self.home, self.course = base, base / "home", base / "course"
        self.home.mkdir(mode=0o700)
        self.secret = self.home / "secret.txt"
        self.secret_text = f"INSTRUCTOR-SECRET-{secrets.token_hex(8)}"
        self.secret.write_text(self.secret_text)
        self.secret.chmod(0o600)
        for part in ("autograde", "solutions", "exercises"):
            shutil.copytree(ROOT / part, self.course / part, ignore=shutil.ignore_patterns("__pycache__"))
        _owned_by_nobody(base)
        self.python = _python_for(AS_NOBODY, base)

    def hand_in(self, submitted: str, student: str, exercise: str,
                notebook: nbformat.NotebookNode | None = None) -> Path:
        assignment = registry.get(exercise).assignment
        path = self.base / submitted / student / assignment / f"{exercise}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        if notebook is None:
            shutil.copyfile(self.course / "solutions" / assignment / f"{exercise}.ipynb", path)
        else:
            nbformat.write(notebook, path)
        _owned_by_nobody(self.base)
        return path

    def grade(self, submitted: str, *extra: str, wrapper: list[str] = (),
              timeout: float = 480) -> subprocess.CompletedProcess:
        """`python -m autograde grade` as `nobody`, in the course's copy, with the course's code;
        the report goes to `<submitted>-grades`."""
        environment = {"PATH": os.defpath, "HOME": str(self.home), "LANG": "C.UTF-8", "PYTHONPATH": str(self.course)}
        return _run([*AS_NOBODY, *wrapper, self.python, "-m", "autograde", "grade", str(self.base / submitted),
                     "--out", str(self.out(submitted)), "--seed", str(SEED), "--jobs", "2", "--timeout", "120",
                     *extra], cwd=self.course, env=environment, timeout=timeout)

    def out(self, submitted: str) -> Path:
        return self.base / f"{submitted}-grades"

    def rows(self, submitted: str) -> dict[tuple[str, str], dict]:
        with (self.out(submitted) / "grades.csv").open() as file:
            return {(row["student"], row["exercise"]): row for row in csv.DictReader(file)}


def _isolation_as_nobody(setting: Setting, wrapper: list[str] = ()) -> str:
    found = _run([*AS_NOBODY, *wrapper, setting.python, "-c",
                  "from autograde.sandbox.isolation import available; print(available())"],
                 cwd=setting.course, env={"PYTHONPATH": str(setting.course)})
    return found.stdout.strip() or found.stderr[-500:]


@pytest.fixture(scope="module")
def setting() -> Setting:
    base = Path(tempfile.mkdtemp(prefix="autograde-instructor-"))  # pytest's own folders are closed to others
    try:
        setting = Setting(base)
        if setting.python is None:
            pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that uid {NOBODY} may start "
                        f"(this one, {sys.executable}, lies in a folder closed to it)")
        yield setting
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Graded:
    def __init__(self, setting: Setting, process: subprocess.CompletedProcess, findings: dict, connections: int,
                 survivors: list[int], before: dict[Path, str]):
        self.setting, self.process, self.findings = setting, process, findings
        self.connections, self.survivors, self.before = connections, survivors, before


@pytest.fixture(scope="module")
def graded(setting: Setting) -> Graded:
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) to ask the kernel whether it allows unprivileged user namespaces")
    # Asked of util-linux, not of the grader: if the kernel allows them, the grader must use them.
    refused = _run([*AS_NOBODY, "unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount",
                    "--ipc", "--uts", "true"], cwd="/")
    if refused.returncode != 0:
        pytest.skip(f"this kernel refuses user namespaces to an unprivileged user: {refused.stderr.strip()}")
    assert _isolation_as_nobody(setting) == "userns"
    for exercise in EXERCISES:
        setting.hand_in("class", "ada", exercise)
        setting.hand_in("class", "mallory", exercise)
    classmate = setting.base / "class" / "ada" / ASSIGNMENT / "sdpa.ipynb"
    marker = f"agdaemon{os.getpid() % 10**6}"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    attack = nbformat.read(setting.course / "solutions" / ASSIGNMENT / "sdpa.ipynb", as_version=4)
    attack.cells.append(nbformat.v4.new_code_cell(
        f"SECRET, COURSE, CLASSMATE = {str(setting.secret)!r}, {str(setting.course)!r}, {str(classmate)!r}\n"
        f"PORT, MARKER = {listener.getsockname()[1]}, {marker!r}\n" + textwrap.dedent(ATTACK)))
    setting.hand_in("class", "mallory", "sdpa", attack)
    watched = [setting.secret, classmate, setting.course / "solutions" / ASSIGNMENT / "sdpa.ipynb",
               setting.course / "autograde" / "__init__.py"]
    before = {path: _digest(path) for path in watched}
    try:
        process = setting.grade("class")
        connections = 0
        while True:
            try:
                listener.accept()[0].close()
                connections += 1
            except BlockingIOError:
                break
        survivors = _processes_named(marker)
    finally:
        listener.close()
        for pid in _processes_named(marker):
            os.kill(pid, signal.SIGKILL)
    feedback = (setting.out("class") / "feedback" / "mallory.md").read_text() if process.returncode == 0 else ""
    found = re.search(r"FINDINGS (\{.*?\})", feedback)
    return Graded(setting, process, json.loads(found.group(1)) if found else {}, connections, survivors, before)


def test_the_grader_runs_each_submission_in_a_user_namespace(graded: Graded):
    assert graded.process.returncode == 0, (graded.process.stdout + graded.process.stderr)[-3000:]
    assert "isolation: userns+seccomp" in graded.process.stdout, graded.process.stdout[-1000:]
    assert "NOT ISOLATED" not in graded.process.stderr


def test_the_solutions_score_full_marks(graded: Graded):
    rows = graded.setting.rows("class")
    for exercise in EXERCISES:
        row = rows["ada", exercise]
        assert (row["score"], row["max_score"], row["status"]) == ("10", "10", "graded"), row
    assert rows["mallory", "mha"]["score"] == "10"


def test_a_submission_cannot_read_the_instructors_private_file(graded: Graded):
    assert graded.findings.get("secret") == "No such file or directory", graded.findings
    everything_written = "".join(path.read_text(errors="replace") for path in graded.setting.out("class").rglob("*")
                                 if path.is_file())
    assert graded.setting.secret_text not in everything_written


def test_a_submission_cannot_read_the_solutions_or_a_classmates_notebook(graded: Graded):
    assert graded.findings.get("solutions") == "No such file or directory", graded.findings
    assert graded.findings.get("classmate") == "No such file or directory", graded.findings


def test_a_submission_cannot_change_the_course_or_a_classmates_notebook(graded: Graded):
    for attempt in ("write-solutions", "plant-in-solutions", "write-classmate"):
        assert graded.findings.get(attempt) == "No such file or directory", graded.findings
    assert graded.findings.get("write-grader") == "Read-only file system", graded.findings  # the grader's code is there
    assert {path: _digest(path) for path in graded.before} == graded.before
    assert not (graded.setting.course / "solutions" / "planted.txt").exists()


def test_a_submission_cannot_reach_the_network(graded: Graded):
    assert graded.findings.get("network") == "Network is unreachable", graded.findings
    assert graded.connections == 0


def test_a_submission_cannot_fill_the_instructors_disk(graded: Graded):
    """Its scratch folder is a tmpfs of bounded size and inodes, mounted in the fork server's own
    mount namespace: writing 1 GiB, or 100,000 empty files, stops at the bound."""
    limits = Limits()
    written_mib, error, files, files_error = graded.findings["fill"]
    assert error == "ENOSPC" and written_mib <= limits.scratch_bytes // 2**20, graded.findings
    assert files_error == "ENOSPC" and files < limits.scratch_files, graded.findings


def test_no_process_of_a_submission_outlives_its_grading(graded: Graded):
    assert graded.findings, "the attacking cell did not report"
    assert graded.survivors == []


def test_the_attacking_student_keeps_the_points_of_their_code(graded: Graded):
    row = graded.setting.rows("class")["mallory", "sdpa"]
    assert (row["score"], row["status"]) == ("10", "graded"), row


REFUSE_USER_NAMESPACES = """
import os, sys
from autograde.sandbox import isolation, syscall_filter
isolation.no_new_privileges()
syscall_filter.install()  # unshare, setns, mount and clone(CLONE_NEW*) refused, as in a locked-down container
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.skipif(not syscall_filter.AVAILABLE, reason="without libseccomp, no way here to refuse user namespaces")
def test_without_user_namespaces_the_grader_refuses_unless_told_and_says_so(setting: Setting):
    wrapper = [setting.python, "-c", REFUSE_USER_NAMESPACES]
    assert _isolation_as_nobody(setting, wrapper) == "session"
    setting.hand_in("lone", "ada", "sdpa")

    refused = setting.grade("lone", wrapper=wrapper, timeout=120)
    assert refused.returncode == 2, (refused.stdout + refused.stderr)[-2000:]
    assert refused.stderr.count("NOT ISOLATED") == 1 and "--unsafe-no-isolation" in refused.stderr
    assert "No sysctl refuses user namespaces here, so a seccomp profile" in refused.stderr
    assert not (setting.out("lone") / "grades.csv").exists()

    allowed = setting.grade("lone", "--unsafe-no-isolation", wrapper=wrapper)
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-2000:]
    assert allowed.stderr.count("NOT ISOLATED") == 1
    assert "isolation: session+seccomp (" in allowed.stdout
    assert setting.rows("lone")["ada", "sdpa"]["score"] == "10"
    assert UNISOLATED_NOTE in (setting.out("lone") / "feedback" / "ada.md").read_text()


# Run as `nobody` in the course's copy, in the group handed over to it: which groups count as
# delegated, then six processes of 1 GiB in one sandboxed submission, its group declared delegated
# as `grade --delegated-cgroup` does (systemd's user manager marks none of the groups it delegates).
TREE_IN_ITS_GROUP = """
import json, os, sys, tempfile
from pathlib import Path
from autograde import registry
from autograde.grading.sandboxed import SandboxedSubmission
from autograde.sandbox import cgroups, client as sandbox
group = cgroups.CGROUPS / sys.argv[3]
found = {"unmarked": cgroups.delegated_cgroup(), "declared": cgroups.delegated_cgroup(declared=True)}
os.setxattr(group, "user.delegate", b"1")  # as systemd's system manager marks a group it delegates
found["marked"] = cgroups.delegated_cgroup()
os.removexattr(group, "user.delegate")
sandbox.declare_delegated_cgroup()
folder = Path(tempfile.mkdtemp(dir=sys.argv[1]))
limits = sandbox.Limits(wall_seconds=90, memory_bytes=4 * 2**30, cell_seconds=60)
outcome = SandboxedSubmission(registry.get("sdpa"), [(1, sys.argv[2])], limits, folder=folder).close()
facts = folder / "work" / "facts.json"
print(json.dumps({"isolation": outcome.isolation, "note": outcome.note, "returncode": outcome.returncode,
                  "output": outcome.output_tail, **(json.loads(facts.read_text()) if facts.exists() else {}),
                  **{key: [str(value[0]), value[1]] for key, value in found.items()}}))
"""


@pytest.mark.skipif(not (CGROUPS / "cgroup.controllers").exists(),
                    reason="cgroup v1 here: a control group is delegated to a user only under version 2")
def test_a_delegated_control_group_bounds_each_submissions_tree_without_root(setting: Setting):
    """An instructor without root whose user has a control group delegated to it (`systemd-run
    --user --scope -p Delegate=yes`, or one an administrator made and handed over the same way, as
    here): each submission gets a group in it, and its whole tree's memory is bounded (six
    processes of 1 GiB under 4 GiB: each within its own limit, the tree not)."""
    delegated = CGROUPS / f"autograde-delegated-{os.getpid()}"
    (CGROUPS / "cgroup.subtree_control").write_text("+memory +pids")
    delegated.mkdir()
    try:
        for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):  # what systemd hands over
            os.chown(delegated / name, NOBODY, NOBODY)
        ran = _run(["sh", "-c", f'echo $$ > {delegated}/cgroup.procs && exec "$@"', "sh", *AS_NOBODY,
                    setting.python, "-c", TREE_IN_ITS_GROUP, str(setting.base), FILL_MEMORY_FROM_SIX_PROCESSES,
                    delegated.name],
                   cwd=setting.course, env={"PYTHONPATH": str(setting.course), "PATH": os.defpath}, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        facts = json.loads(ran.stdout.splitlines()[-1])
    finally:
        for group in sorted(delegated.rglob("*/"), key=lambda path: -len(path.parts)):
            if (group / "cgroup.procs").exists():
                group.rmdir()
        delegated.rmdir()
    # Owned by the user is not enough (so are the groups of a user's session): marked, or declared.
    unmarked = f"{delegated} is not marked as delegated (grade --delegated-cgroup says it is)"
    assert facts["unmarked"] == ["None", unmarked], facts
    assert facts["declared"] == facts["marked"] == [str(delegated), ""], facts
    assert facts["isolation"].startswith("userns+cgroup"), facts
    assert f"0::/{delegated.name}/autograde-" in facts["cgroup"], facts
    assert 1 <= facts["held"] <= 3, facts


@pytest.mark.skipif((CGROUPS / "cgroup.controllers").exists(),
                    reason="cgroup v2 here: the test above checks why a group is not taken")
def test_a_control_group_declared_delegated_under_cgroup_v1_is_refused_with_the_reason(setting: Setting):
    """`grade --delegated-cgroup` on a cgroup v1 machine: the grader says why no notebook gets a group."""
    assert cgroups.delegated_cgroup(declared=True) == (None, "cgroup v1: no group is delegated to a user")
    said = _run([*AS_NOBODY, setting.python, "-c", "from autograde.frontends import cli; "
                 "print(cli.delegated_cgroup_usable())"], cwd=setting.course, env={"PYTHONPATH": str(setting.course)})
    assert said.stdout.strip() == "False", said.stderr[-2000:]
    assert "*** --delegated-cgroup: cgroup v1: no group is delegated to a user. No notebook gets" in said.stderr
