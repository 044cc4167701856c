"""Hostile and broken submissions: each loses what could not be graded, and nobody else is affected."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autograde import registry
from autograde.grading import batch, grade
from autograde.grading.sandboxed import SandboxedSubmission
from autograde.sandbox import cgroups, isolation, syscall_filter
from autograde.sandbox import client as sandbox
from tests.fixtures.attacks import FILL_MEMORY_FROM_SIX_PROCESSES
from tests.fixtures.implementations import MHA_WRONG
from tests.fixtures.notebooks import SEED, answer, learner_notebook, write

pytestmark = [pytest.mark.xdist_group("autograde_sandbox"), pytest.mark.timeout(600)]

LIMITS = sandbox.Limits(wall_seconds=30, cpu_seconds=10, memory_bytes=3 * 2**30, file_bytes=2**20,
                        cell_seconds=2, case_seconds=2)
SDPA, CAUSAL = "scaled_dot_product_attention", "causal_mask"
ENDLESS_LOOP_IGNORING_ALARMS = """
while True:
    try:
        while True:
            pass
    except BaseException:
        pass
"""

SUBMISSIONS = {
    # student: (exercise, answers replacing solution cells)
    "ada": ("sdpa", {}),
    "lacks-a-function": ("sdpa", {CAUSAL: "# to do\n"}),
    "syntax-error": ("sdpa", {CAUSAL: "def causal_mask(L, S=None, device=None):\n"
                                      "    return torch.ones(L, S dtype=torch.bool)\n"}),
    "exits-at-import": ("sdpa", {SDPA: "import sys\nsys.exit('bye')\n" + answer("sdpa", SDPA)}),
    "ends-its-process": ("sdpa", {SDPA: "import os\nos._exit(3)\n" + answer("sdpa", SDPA)}),
    "loops-at-import": ("sdpa", {CAUSAL: "while True:\n    pass\n" + answer("sdpa", CAUSAL)}),
    "loops-in-a-function": ("sdpa", {CAUSAL: "def causal_mask(L, S=None, device=None):\n"
                                             "    while True:\n        pass\n"}),
    "ignores-alarms": ("sdpa", {SDPA: ENDLESS_LOOP_IGNORING_ALARMS + answer("sdpa", SDPA)}),
    "hogs-memory-and-disk": ("sdpa", {
        SDPA: answer("sdpa", SDPA) + "\nimport mmap\nmmap.mmap(-1, 4 * 2**30)\n",
        CAUSAL: answer("sdpa", CAUSAL) + "\nopen('big.bin', 'wb').write(b'x' * 2**21)\n"}),
    "hides-torch-sdpa": ("mha", next(v for v in MHA_WRONG if v.name == "hides-torch-sdpa-behind-getattr").answers),
}


@pytest.fixture(scope="module")
def grades(tmp_path_factory) -> dict[str, grade.Grade]:
    submitted = tmp_path_factory.mktemp("hostile")
    for student, (exercise_id, answers) in SUBMISSIONS.items():
        write(learner_notebook(exercise_id, answers), submitted / student / "attention" / f"{exercise_id}.ipynb")
    rows = batch.grade_all(submitted, SEED, jobs=2, limits=LIMITS, progress=False)
    mine = {student: exercise_id for student, (exercise_id, _) in SUBMISSIONS.items()}
    return {student: g for student, g in rows if g.exercise.id == mine[student]}


def test_others_are_unaffected(grades):
    assert (grades["ada"].status, grades["ada"].score) == (grade.GRADED, 10)


def test_a_missing_function_loses_its_tests_only(grades):
    result = grades["lacks-a-function"]
    assert (result.status, result.score) == (grade.GRADED, 8)
    assert result.reason == "the notebook defines no `causal_mask`; " \
                            "failed: causal-mask-square, causal-mask-rectangular, causal-mask-random"


def test_a_syntax_error_is_located(grades):
    result = grades["syntax-error"]
    assert result.score == 8
    assert result.notes[0] == "the notebook defines no `causal_mask`"
    assert result.notes[1].startswith("SyntaxError: ")
    assert result.notes[1].endswith("line 2: `return torch.ones(L, S dtype=torch.bool)`")


def test_sys_exit_at_import_stops_that_cell_only(grades):
    result = grades["exits-at-import"]
    assert (result.status, result.score) == (grade.GRADED, 2)  # the causal mask, in another cell, counts
    assert result.notes[0] == "the notebook defines no `scaled_dot_product_attention`"
    assert result.notes[1].startswith("SystemExit: bye, at cell ")
    assert result.notes[1].endswith("line 2: `sys.exit('bye')`")


def test_a_process_that_ends_itself_loses_what_did_not_run(grades):
    result = grades["ends-its-process"]
    assert (result.status, result.score) == (grade.INCOMPLETE, 0)
    assert result.reason.startswith("the grading process exited with status 3 during cell ")
    assert result.results[0].problems[0].startswith("not run: the grading process exited with status 3")


def test_an_endless_loop_at_import_is_stopped_and_reported(grades):
    result = grades["loops-at-import"]
    assert result.score == 8
    assert result.notes[1].endswith("was stopped after 2 s")


def test_an_endless_loop_in_a_function_fails_its_tests(grades):
    result = grades["loops-in-a-function"]
    assert result.score == 8
    causal = [r for r in result.results if r.name.startswith("causal-mask")]
    assert all(r.problems == ("stopped after 2 s (an endless loop?)",) for r in causal)


def test_a_loop_that_ignores_alarms_is_killed_at_a_time_limit(grades):
    """Killed at its CPU time limit (10 s here, before the 30 s of wall clock): by SIGKILL, which the
    namespace's first process cannot ignore as it does SIGXCPU, and named as that limit."""
    result = grades["ignores-alarms"]
    assert (result.status, result.score) == (grade.INCOMPLETE, 0)
    assert "was killed by SIGKILL at its 10 s CPU time limit" in result.reason, result.reason


def test_memory_and_file_size_are_limited(grades):
    result = grades["hogs-memory-and-disk"]
    assert result.score == 10
    assert any("Cannot allocate memory" in note for note in result.notes)
    assert any("File too large" in note for note in result.notes)


def test_a_not_allowed_call_hidden_from_the_scan_trips_the_wire(grades):
    result = grades["hides-torch-sdpa"]
    assert (result.status, result.score) == (grade.NOT_ALLOWED, 0)
    assert result.reason.startswith("uses torch.nn.functional.scaled_dot_product_attention (cell ")
    assert "`out = fused(q, k, v, attn_mask=mask)`" in result.reason


REPORT_THE_PROCESS = """
import json, os, resource, socket, sys
limits = {name: resource.getrlimit(getattr(resource, name))[0]
          for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC")}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    network = "connected"
except OSError as exc:
    network = exc.strerror
json.dump({"environment": dict(os.environ), "cwd": os.getcwd(), "isolated": sys.flags.isolated,
           "uid": os.getuid(), "pid": os.getpid(), "processes": sorted(os.listdir("/proc")),
           "root": sorted(os.listdir("/")), "course": sorted(os.listdir(ROOT)), "network": network,
           "descriptors": sorted(os.listdir("/proc/self/fd")), "limits": limits,
           "devices": sorted(os.listdir("/dev"))}, open("facts.json", "w"))
"""


@pytest.mark.timeout(60)
def test_a_cells_failure_names_it_by_position_and_by_the_number_jupyter_shows(tmp_path: Path):
    """`check()` in the kernel names a cell `In [7]`, as Jupyter numbers it: the grader's feedback says both."""
    submission = SandboxedSubmission(registry.get("sdpa"), [(2, "x = 1", 4), (3, "x = 1 / 0", 7), (5, "y = (")],
                                     LIMITS, folder=tmp_path)
    try:
        failures = [failure.describe() for failure in submission.failed_cells]
    finally:
        submission.close()
    assert failures[0].startswith("ZeroDivisionError: division by zero, at cell 3 (In [7]), line 1"), failures
    assert failures[1].startswith("SyntaxError: ") and "at cell 5, line 1" in failures[1], failures


@pytest.mark.timeout(120)
def test_the_worker_runs_isolated_limited_and_without_the_graders_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("AUTOGRADE_SEED", "12345")
    monkeypatch.setenv("INSTRUCTOR_TOKEN", "secret")
    work = tmp_path / "work"
    cell = f"ROOT = {str(sandbox.ROOT)!r}\n" + REPORT_THE_PROCESS
    outcome = SandboxedSubmission(registry.get("sdpa"), [(1, cell)], LIMITS, folder=tmp_path).close()
    assert outcome.returncode == 0, outcome.output_tail
    facts = json.loads((work / "facts.json").read_text())
    assert not {"AUTOGRADE_SEED", "INSTRUCTOR_TOKEN"} & set(facts["environment"])
    assert facts["environment"]["HOME"] == facts["cwd"] == str(work)
    assert facts["isolated"] == 1
    assert facts["limits"]["RLIMIT_CPU"] == LIMITS.cpu_seconds
    assert facts["limits"]["RLIMIT_AS"] == LIMITS.memory_bytes
    assert facts["limits"]["RLIMIT_FSIZE"] == LIMITS.file_bytes
    assert facts["limits"]["RLIMIT_NOFILE"] == LIMITS.open_files
    assert facts["descriptors"] == ["0", "1", "2", "3"]  # the standard three, and the one listing them
    if os.getuid() != 0:
        assert outcome.isolation == "session"
        return
    assert outcome.isolation == sandbox.FULL_ISOLATION, outcome.note
    assert facts["uid"] >= sandbox.FIRST_UID
    assert facts["limits"]["RLIMIT_NPROC"] == LIMITS.extra_processes
    # The submission is its PID namespace's first process: it sees itself alone.
    assert facts["pid"] == 1 and [p for p in facts["processes"] if p.isdigit()] == ["1"]
    assert facts["course"] == [".venv", "autograde"] or facts["course"] == ["autograde"]
    assert "home" not in facts["root"] and "work" in facts["root"] or "mnt" not in facts["root"]
    assert facts["network"] == "Network is unreachable"
    # sdpa runs no GPU kernel: whatever GPU the machine has, its devices are not in this root.
    assert facts["devices"] == sorted([*isolation.DEVICES, "shm"])


LEAVE_A_DAEMON = """
import ctypes, json, os, resource, time
if os.fork() == 0:  # a daemon: a new session, a second fork, then sleep past the grading
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, MARKER.encode(), 0, 0, 0)
        open("daemon-started", "w").close()
        time.sleep(60)
    os._exit(0)
time.sleep(0.5)
json.dump({"uid": os.getuid(), "processes": resource.getrlimit(resource.RLIMIT_NPROC)[0]}, open("facts.json", "w"))
"""

WITHOUT_NAMESPACES = """
import sys
from pathlib import Path
from autograde import registry
from autograde.sandbox import client as sandbox
from autograde.sandbox import syscall_filter
from autograde.grading.sandboxed import SandboxedSubmission
limits = sandbox.Limits(wall_seconds=30, extra_processes=16)
outcome = SandboxedSubmission(registry.get("sdpa"), [(1, sys.argv[2])], limits, folder=Path(sys.argv[1])).close()
print(outcome.returncode, outcome.isolation, outcome.note, sep="|")
"""


def processes_named(name: str) -> list[int]:
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == name:
                found.append(int(comm.parent.name))
        except OSError:
            pass
    return found


REFUSE_NAMESPACES = """
import os, sys
from autograde.sandbox import isolation, syscall_filter
isolation.no_new_privileges()
syscall_filter.install()  # unshare, setns, mount and clone(CLONE_NEW*) refused, as Docker's default profile does
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("user_namespaces", [True, False], ids=["user-namespaces", "no-user-namespaces"])
def test_as_root_without_cap_sys_admin_each_submission_still_gets_its_own_uid_and_leaves_nothing(
        tmp_path: Path, user_namespaces: bool):
    """As in a container without CAP_SYS_ADMIN (Gradescope's, Docker's default): with user
    namespaces, the same namespaces inside one; where a seccomp profile refuses those too, a session."""
    if not user_namespaces and not syscall_filter.AVAILABLE:
        pytest.skip("without libseccomp, no way here to refuse user namespaces")
    marker = f"agdaemon{os.getpid() % 10**6}"
    work = tmp_path / "work"
    cell = f"MARKER = {marker!r}\n" + LEAVE_A_DAEMON
    refuse = [] if user_namespaces else ["-c", REFUSE_NAMESPACES]
    try:
        process = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", sys.executable, *refuse,
                                  "-c", WITHOUT_NAMESPACES, str(tmp_path), cell],
                                 cwd=sandbox.ROOT, capture_output=True, text=True, timeout=100)
        returncode, isolation, note = process.stdout.strip().splitlines()[-1].split("|")
        survivors = processes_named(marker)
    finally:
        for pid in processes_named(marker):
            os.kill(pid, signal.SIGKILL)
    expected = "userns+uid+cgroup+seccomp" if user_namespaces else "session+uid+cgroup+seccomp"
    assert (returncode, isolation) == ("0", expected), process.stderr[-2000:]
    assert "root, but no namespaces" in note and "Operation not permitted" in note
    facts = json.loads((work / "facts.json").read_text())
    assert facts["uid"] >= sandbox.FIRST_UID and facts["processes"] == 16
    assert (work / "daemon-started").exists() and survivors == []


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.getuid() != 0, reason="cgroups need root")
def test_the_memory_limit_holds_for_the_whole_process_tree(tmp_path: Path):
    """Six processes of 1 GiB each, under a 4 GiB limit: each process alone is within its address
    space, the tree is not, and the tree is what counts. (Without the cgroup all six would hold.)"""
    work = tmp_path / "work"
    # Time limits far above the seconds this takes here: the test is about memory, not time. In the
    # cgroup v2 virtual machine, whose CPU is emulated, on a busy machine, the worker once ended
    # normally without writing its facts, as a cell stopped by a 60 s limit does.
    limits = sandbox.Limits(wall_seconds=600, memory_bytes=4 * 2**30, cell_seconds=540)
    outcome = SandboxedSubmission(registry.get("sdpa"), [(1, FILL_MEMORY_FROM_SIX_PROCESSES)], limits,
                                  folder=tmp_path).close()
    assert outcome.isolation == sandbox.FULL_ISOLATION and outcome.returncode == 0, outcome.output_tail
    facts = json.loads((work / "facts.json").read_text())
    # inside the group the grader runs in (v1: in its memory hierarchy; v2: the group it started in)
    groups = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
    own = groups.get("memory", groups.get("")).removesuffix("/" + cgroups.REST).rstrip("/")
    assert re.search(rf"^(\d+:memory|0:):{re.escape(own)}/autograde-\d+-\d+$", facts["cgroup"], re.M), \
        (own, facts["cgroup"])
    assert 1 <= facts["held"] <= 3


FILL_THE_SCRATCH_FOLDER = """
import errno, json, os
written, error = 0, None
try:
    for n in range(64):
        with open(f"fill-{n}", "wb") as file:
            for _ in range(16):
                file.write(b"x" * 2**20)
                written += 2**20
except OSError as exc:
    error = errno.errorcode.get(exc.errno)
os.remove("fill-0")
json.dump({"written": written, "error": error}, open("facts.json", "w"))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.getuid() != 0, reason="as root; tests/test_autograde_unprivileged.py fills it without root")
def test_a_submission_cannot_fill_the_graders_disk(tmp_path: Path):
    """Its scratch folder is a tmpfs of bounded size: writing 1 GiB stops at the bound, with ENOSPC."""
    limits = sandbox.Limits(wall_seconds=60, scratch_bytes=64 * 2**20)
    outcome = SandboxedSubmission(registry.get("sdpa"), [(1, FILL_THE_SCRATCH_FOLDER)], limits,
                                  folder=tmp_path).close()
    assert outcome.returncode == 0, outcome.output_tail
    facts = json.loads((tmp_path / "work" / "facts.json").read_text())
    assert facts["error"] == "ENOSPC" and facts["written"] <= 64 * 2**20
    assert not list((tmp_path / "work").glob("fill-*"))  # gone with the tmpfs: nothing left on the disk


TRY_REFUSED_CALLS = """
import ctypes, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
NUMBERS = {"x86_64": {"keyctl": 250, "ptrace": 101, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
                      "clone": 56, "setns": 308},
           "aarch64": {"keyctl": 219, "ptrace": 117, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
                       "clone": 220, "setns": 268}}[os.uname().machine]
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17

def errno_of(result):
    return "allowed" if result >= 0 else os.strerror(ctypes.get_errno())

found = {name: errno_of(libc.syscall(NUMBERS[name], 0, 0, 0, 0, 0))
         for name in ("keyctl", "ptrace", "bpf", "perf_event_open", "userfaultfd")}
found["setns"] = errno_of(libc.syscall(NUMBERS["setns"], 0, CLONE_NEWNET))
found["unshare"] = errno_of(libc.unshare(CLONE_NEWUSER))
found["mount"] = errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
found["umount"] = errno_of(libc.umount2(b"/proc", 2))
child = libc.syscall(NUMBERS["clone"], CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if child == 0:
    os._exit(0)
found["clone-new-user"] = errno_of(child)
thread = threading.Thread(target=lambda: found.update(thread="ran"))
thread.start()
thread.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
found["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
json.dump(found, open("facts.json", "w"))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not syscall_filter.AVAILABLE, reason="libseccomp is not installed")
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64 and aarch64")
def test_the_syscall_filter_refuses_what_a_submission_never_needs(tmp_path: Path):
    """Keyrings, ptrace, bpf, perf events, userfaultfd, mounts and new namespaces answer EPERM;
    threads and fork, which torch and the learner's code use, still work."""
    outcome = SandboxedSubmission(registry.get("sdpa"), [(1, TRY_REFUSED_CALLS)], LIMITS, folder=tmp_path).close()
    assert outcome.returncode == 0 and outcome.isolation.endswith("+seccomp"), outcome.output_tail
    facts = json.loads((tmp_path / "work" / "facts.json").read_text())
    refused = {name: "Operation not permitted" for name in ("keyctl", "ptrace", "bpf", "perf_event_open",
                                                            "userfaultfd", "setns", "unshare", "mount", "umount",
                                                            "clone-new-user")}
    assert facts == {**refused, "thread": "ran", "fork": 7}


def test_only_an_exercise_that_runs_gpu_kernels_gets_the_gpu(monkeypatch):
    """A GPU's memory is beyond the cgroup: its device nodes go only into the root of a worker
    whose exercise compiles kernels for it (flash_triton), never into the others'."""
    assert {exercise.id for exercise in registry.EXERCISES.values() if exercise.gpu} == {"flash_triton"}
    on_a_gpu_machine = ["console", "null", "nvidia-uvm", "nvidia0", "nvidiactl", "sda", "urandom"]
    monkeypatch.setattr(isolation.os, "listdir", lambda path: on_a_gpu_machine if path == "/dev" else [])
    assert isolation.device_nodes(gpu=False) == isolation.DEVICES
    assert isolation.device_nodes(gpu=True) == (*isolation.DEVICES, "nvidia-uvm", "nvidia0", "nvidiactl")


def test_a_worker_with_the_gpu_is_limited_by_its_data_not_its_address_space(monkeypatch):
    """CUDA reserves about 18 GB of address space once initialised (H100): under the address-space
    limit it finds no GPU, so a worker with the GPU has its private writable memory limited instead."""
    from autograde.sandbox import server

    assert server.memory_rlimit(gpu=True) == server.memory_rlimit(gpu=False) == resource.RLIMIT_AS  # no GPU here
    monkeypatch.setattr(isolation, "gpu_nodes", lambda: ("nvidia0", "nvidiactl"))
    assert server.memory_rlimit(gpu=True) == resource.RLIMIT_DATA
    assert server.memory_rlimit(gpu=False) == resource.RLIMIT_AS


def test_a_worker_with_the_gpu_has_a_writable_proc_and_no_case_measured_from_outside(monkeypatch):
    """A read-only /proc keeps a submission from resetting the memory the fork server measures, but
    CUDA's initialisation fails on one (cuInit: 304, "OS call failed", in a sandboxed worker on an
    H100; 0 with /proc writable): a worker with the GPU has it writable, so its exercise may have no
    case measured from outside."""
    assert isolation.proc_flags(gpu=True) & isolation.MS_RDONLY  # no GPU here
    monkeypatch.setattr(isolation, "gpu_nodes", lambda: ("nvidia0", "nvidiactl"))
    assert not isolation.proc_flags(gpu=True) & isolation.MS_RDONLY
    assert isolation.proc_flags(gpu=False) & isolation.MS_RDONLY
    for exercise in registry.EXERCISES.values():
        measured = "cost_measured(" in registry.test_file(exercise).read_text()
        assert not (exercise.gpu and measured), exercise.id


ASK_NO_DRIVER = """
import sys, torch
def refuse(*args):
    raise SystemExit("the CUDA driver was asked")
torch.cuda.is_available = torch.cuda.device_count = torch.cuda.init = refuse
sys.path.insert(0, sys.argv[1])
from autograde.sandbox import server
"""


def test_the_fork_server_never_asks_the_cuda_driver():
    """Asked before the fork server forks, the driver starts a thread of its own (seen on an H100:
    `cuda00001800007`), and a fork beside a thread is unsafe: the server refused every job. The
    exercises' modules learn from their environment instead (TRITON_INTERPRET, set by the grader)."""
    env = {**sandbox.scrubbed_environment("/nonexistent"), **registry.get("flash_triton").env}
    assert set(env) >= {"TRITON_INTERPRET"}
    started = subprocess.run([sys.executable, "-I", "-c", ASK_NO_DRIVER, str(sandbox.ROOT)], env=env,
                             capture_output=True, text=True, cwd="/")
    assert started.returncode == 0, started.stderr[-2000:]


HOLD_THE_GPU = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from autograde.sandbox import client
held = client.gpu_turn(Path(sys.argv[2]))
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def holding_the_gpu(lock: Path, seconds: float) -> subprocess.Popen:
    """Another grading process (or run) with a worker on the GPU, for `seconds`; back once it holds it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_GPU, str(sandbox.ROOT), str(lock), str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_workers_with_the_gpu_take_turns_across_processes(tmp_path: Path):
    """One at a time on the machine, whichever grading process or run starts them; a grader that
    dies gives its turn back with its descriptors."""
    lock = tmp_path / "gpu.lock"
    holder = holding_the_gpu(lock, 2.0)
    started = time.monotonic()
    sandbox.gpu_turn(lock).close()
    assert time.monotonic() - started > 1.5 and holder.wait() == 0
    holder = holding_the_gpu(lock, 60.0)
    holder.kill()
    holder.wait()
    started = time.monotonic()
    sandbox.gpu_turn(lock).close()
    assert time.monotonic() - started < 5


def test_a_notebook_with_the_gpu_waits_for_its_turn_and_then_runs(tmp_path: Path, monkeypatch):
    """Where the machine has a GPU, a flash_triton worker starts only once no other worker has the
    GPU, and its clock starts then; a worker without the GPU never waits."""
    lock = tmp_path / "gpu.lock"
    monkeypatch.setattr(sandbox, "GPU_TURN_LOCK", lock)
    monkeypatch.setattr(isolation, "gpu_nodes", lambda: ("nvidia0", "nvidiactl"))
    sandbox.fork_server()  # started beforehand: its start is no wait for a turn
    # Read from the order of events, not from a clock, so that a busy machine changes nothing: the
    # sdpa worker starts while another process holds the GPU (for a minute); the flash_triton
    # worker only once that process, a second after its start, has been told to give it back.
    started = {}
    for exercise_id, give_back_after in (("sdpa", 60.0), ("flash_triton", 1.0)):
        exercise = registry.get(exercise_id)
        holder = holding_the_gpu(lock, 60.0)
        giving_back = threading.Event()

        def give_back(holder=holder, giving_back=giving_back):
            giving_back.set()  # before the turn is free
            holder.kill()

        timer = threading.Timer(give_back_after, give_back)
        timer.start()
        submission = SandboxedSubmission(exercise, [(1, f"def {exercise.required[0]}():\n    return 6 * 7")],
                                         sandbox.Limits(wall_seconds=20), folder=tmp_path / exercise_id)
        started[exercise_id] = "after the GPU was given back" if giving_back.is_set() else "while it was held"
        assert submission.call(exercise.required[0], (), {}) == 42 and submission.close().returncode == 0
        timer.cancel()
        holder.kill()
        holder.wait()
    assert started == {"sdpa": "while it was held", "flash_triton": "after the GPU was given back"}


def test_a_learners_temporary_files_go_to_its_scratch_folder(tmp_path: Path):
    """The fork server found its temporary folder (/tmp, read-only in a worker's root) before the
    worker's TMPDIR was set; a learner's `tempfile` (and Triton's builds) now finds the scratch folder."""
    job = tmp_path / "job"
    job.mkdir()
    temporary = "def scaled_dot_product_attention():\n    import tempfile\n    with tempfile.NamedTemporaryFile():\n" \
                "        return tempfile.gettempdir()"
    submission = SandboxedSubmission(registry.get("sdpa"), [(1, temporary)], LIMITS, folder=job)
    try:
        found = submission.call(SDPA, (), {})
    finally:
        submission.close()
    assert found == str(job / "work")


# A stand-in for the CUDA driver's library, and a module linked against it as Triton links its
# launcher: what a flash_triton worker on a GPU machine builds before its first kernel.
STUB_DRIVER = "int cuDriverGetVersion(int *version) { *version = 13000; return 0; }\n"
LINKED_TO_THE_DRIVER = r'''
def flash_attention_triton():
    from triton.backends.nvidia import driver
    from triton.runtime.build import compile_module_from_src
    source = """
#include <Python.h>
int cuDriverGetVersion(int *version);
static PyObject *version(PyObject *self, PyObject *args) {
    int v = 0;
    cuDriverGetVersion(&v);
    return PyLong_FromLong(v);
}
static PyMethodDef methods[] = {{"version", version, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "linked", NULL, -1, methods};
PyMODINIT_FUNC PyInit_linked(void) { return PyModule_Create(&module); }
"""
    folders = driver.libcuda_dirs()
    linked = compile_module_from_src(source, "linked", library_dirs=folders, include_dirs=[],
                                     libraries=driver.libraries)
    return f"{':'.join(folders)} {linked.version()}"
'''


def test_a_worker_with_the_gpu_links_against_the_driver_in_a_folder_closed_to_it(tmp_path: Path, monkeypatch):
    """On an H100 VM, Triton in a flash_triton worker found no `libcuda.so.1` ("libcuda.so cannot
    found!"): the driver lay in folders the worker's uid could not enter. Here the driver's library
    (a stand-in) lies in a folder closed to everyone but root; the worker finds it where Triton
    looks, and Triton compiles, links and loads a module against it, inside the sandbox."""
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler here: Triton needs one to link against the driver")
    closed = tmp_path / "driver"
    (closed / "lib64").mkdir(parents=True)
    (closed / "stub.c").write_text(STUB_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(closed / "lib64" / "libcuda.so.1"),
                    str(closed / "stub.c")], check=True)
    closed.chmod(0o700)
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(closed / "lib64"))  # where the grader finds it
    monkeypatch.setattr(sandbox, "GPU_TURN_LOCK", tmp_path / "gpu.lock")
    monkeypatch.setattr(isolation, "gpu_nodes", lambda: ("nvidia0", "nvidiactl"))
    (tmp_path / "job").mkdir()
    submission = SandboxedSubmission(registry.get("flash_triton"), [(1, LINKED_TO_THE_DRIVER)],
                                     sandbox.Limits(wall_seconds=120), folder=tmp_path / "job")
    try:
        linked = submission.call("flash_attention_triton", (), {})
    finally:
        outcome = submission.close()
    assert linked == f"{isolation.DRIVER_FOLDER} 13000", outcome.output_tail
    assert outcome.returncode == 0, outcome.output_tail


def test_the_grader_finds_the_driver_where_triton_would(tmp_path: Path, monkeypatch):
    """TRITON_LIBCUDA_PATH's folder first, else the loader's cache, then LD_LIBRARY_PATH; the file
    itself, links resolved (a worker's root binds the file, not the link)."""
    named, listed = tmp_path / "named", tmp_path / "listed"
    for folder in (named, listed):
        folder.mkdir()
        (folder / "libcuda.so.580.1").write_bytes(b"")
        (folder / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(named))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(listed))
    assert sandbox.driver_library() == str(named / "libcuda.so.580.1")
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path))
    assert sandbox.driver_library() is None
    monkeypatch.delenv("TRITON_LIBCUDA_PATH")
    if "libcuda.so.1" not in subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout:
        assert sandbox.driver_library() == str(listed / "libcuda.so.580.1")


def test_the_worker_is_started_with_its_exercises_gpu_choice(tmp_path: Path, monkeypatch):
    started = []
    real_start = sandbox.ForkServer.start

    def start(self, folder, limits, env={}, gpu=False, scratch=None):
        started.append(gpu)
        return real_start(self, folder, limits, env, gpu, scratch)

    monkeypatch.setattr(sandbox.ForkServer, "start", start)
    for exercise_id in ("sdpa", "flash_triton"):
        (tmp_path / exercise_id).mkdir()
        SandboxedSubmission(registry.get(exercise_id), [(1, "x = 1")], LIMITS, folder=tmp_path / exercise_id).close()
    assert started == [False, True]

