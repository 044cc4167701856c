"""The Slurm recipe (`autograde/deploy/slurm-array.sh`) on a real Slurm: the commands of its header,
as they are, on a cluster of this one machine, against one run over the whole class.

slurmctld and slurmd run as root on localhost, configured in a temporary folder (the node's real
CPUs and memory, processes tracked by their parents: no cgroup plugin), with their own munge
daemon and key; all three stop when the test ends, however it ends. Debian's `slurm-wlm` and
`munge` are installed with apt where missing, when the tests run as root.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograde.grading import journal, provenance
from tests import debian_packages
from tests.fixtures.notebooks import ROOT, SEED, answer, learner_notebook, write
from tests.test_autograde_resume import descendants, groups_left, submission_groups
from tests.test_autograde_shards import without_timings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(os.getuid() != 0, reason="slurmd runs as root here")]

RECIPE = ROOT / "autograde" / "deploy" / "slurm-array.sh"
PROGRAMS = {"slurm-wlm": ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel"), "munge": ("munged",)}
SHARDS = 3
SLOW_CELL = "import time\ntime.sleep(15)\n"  # a notebook that is still being graded when its task is requeued
SDPA = "scaled_dot_product_attention"
OUTPUTS = ("grades.csv", "results.csv", "canvas.csv", "moodle.csv")


def _installed() -> None:
    missing = [package for package, programs in PROGRAMS.items()
               if not all(shutil.which(program, path="/usr/sbin:/usr/bin") for program in programs)]
    if missing:
        try:
            debian_packages.install(missing)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"a real Slurm is needed: {exc}; install Debian's {' '.join(missing)}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node() -> dict[str, str]:
    """This machine as slurmd sees it: NodeName, CPUs, RealMemory..."""
    found = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", found.splitlines()[0]))


class Cluster:
    """slurmctld, slurmd and munged in `folder`; `run` runs a command as one of the cluster's users."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        node = _node()
        for name in ("state", "spool", "munge"):
            (folder / name).mkdir(mode=0o700)
        key = folder / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = folder / "munge" / "munge.socket"
        settings = {
            "ClusterName": "autograde", "SlurmctldHost": f"{node['NodeName']}(127.0.0.1)",
            "SlurmUser": "root", "SlurmdUser": "root",
            "SlurmctldPort": _free_port(), "SlurmdPort": _free_port(),
            "AuthType": "auth/munge", "CredType": "cred/munge", "AuthInfo": f"socket={self.munge_socket}",
            "StateSaveLocation": folder / "state", "SlurmdSpoolDir": folder / "spool",
            "SlurmctldPidFile": folder / "slurmctld.pid", "SlurmdPidFile": folder / "slurmd.pid",
            "SlurmctldLogFile": folder / "slurmctld.log", "SlurmdLogFile": folder / "slurmd.log",
            "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none", "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none", "SwitchType": "switch/none", "MpiDefault": "none",
            "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
            "SchedulerType": "sched/backfill", "ReturnToService": 2, "KillWait": 30, "MinJobAge": 3600,
            "PlugStackConfig": folder / "plugstack.conf",
        }
        (folder / "plugstack.conf").write_text("")
        self.conf.write_text("".join(f"{key}={value}\n" for key, value in settings.items())
                             + f"NodeName={node['NodeName']} NodeAddr=127.0.0.1 CPUs={node['CPUs']} "
                               f"RealMemory={node['RealMemory']} State=UNKNOWN\n"
                               "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
        self.environment = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        self._daemon(["munged", "--foreground", "--force", "--key-file", str(self.folder / "munge" / "munge.key"),
                      "--socket", str(self.munge_socket), "--pid-file", str(self.folder / "munge" / "munged.pid"),
                      "--log-file", str(self.folder / "munge" / "munged.log"),
                      "--seed-file", str(self.folder / "munge" / "munged.seed")])
        self._wait_for(lambda: self.munge_socket.exists(), "munged")
        self._daemon(["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._daemon(["slurmd", "-D", "-f", str(self.conf)])
        self._wait_for(lambda: " idle" in self.run("sinfo", "-h", "-o", "%N %t").stdout, "an idle node")

    def _daemon(self, command: list[str]) -> None:
        log = (self.folder / f"{command[0]}.out").open("wb")
        self.daemons.append(subprocess.Popen(command, env=self.environment, stdout=log, stderr=log,
                                             start_new_session=True))

    def _wait_for(self, ready, what: str, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            ended = [d.args[0] for d in self.daemons if d.poll() is not None]
            if ended or time.monotonic() > deadline:
                logs = "".join(path.read_text(errors="replace")[-2000:] for path in self.folder.glob("*.log"))
                raise AssertionError(f"{what} not ready (ended: {ended}):\n{logs}")
            time.sleep(0.5)

    def run(self, *command: str, check: bool = True, cwd: Path = ROOT, **extra) -> subprocess.CompletedProcess:
        return subprocess.run(command, env={**self.environment, **extra}, cwd=cwd, capture_output=True, text=True,
                              check=check, timeout=120)

    def requeue(self, job: str, seconds: float = 10) -> None:
        """`scontrol requeue`, tried again while the controller refuses it: a task that has just started
        may not be requeued until its launch is confirmed, which takes a moment on a loaded machine."""
        deadline = time.monotonic() + seconds
        while (done := self.run("scontrol", "requeue", job, check=False)).returncode:
            assert time.monotonic() < deadline, \
                done.stderr + self.run("scontrol", "show", "job", job, check=False).stdout
            time.sleep(0.5)

    def jobs(self) -> dict[str, str]:
        """Every job the controller knows, array tasks one by one: id -> state."""
        shown = self.run("squeue", "-h", "-r", "-t", "all", "-o", "%i %T").stdout.split()
        return dict(zip(shown[::2], shown[1::2]))

    def wait_until_done(self, job: str, seconds: float = 900) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            state = self.run("scontrol", "show", "job", job, check=False).stdout
            found = re.search(r"JobState=(\w+)", state)
            if found and found.group(1) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return found.group(1)
            time.sleep(1)
        raise AssertionError(f"job {job} did not end: {self.run('squeue', '-t', 'all').stdout}")

    def stop(self) -> None:
        """Every job cancelled and every daemon stopped; whatever they left is killed."""
        if self.daemons and self.daemons[1:2] and self.daemons[1].poll() is None:
            self.run("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                    state in ("RUNNING", "COMPLETING") for state in self.jobs().values()):
                time.sleep(1)
        started = {d.pid for d in self.daemons}
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in _left_behind(started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _left_behind(daemons: set[int]) -> list[int]:
    """The job steps and what they ran: slurmstepd processes, which detach from slurmd, and theirs."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        parents[int(stat.parent.name)] = (int(text[text.rindex(")") + 2:].split()[1]), command)
    steps = {pid for pid, (_, command) in parents.items() if command.startswith(b"slurmstepd")} | daemons
    found = set()
    for pid in parents:
        ancestor = pid
        while ancestor in parents and ancestor not in steps and ancestor > 1:
            ancestor = parents[ancestor][0]
        if ancestor in steps:
            found.add(pid)
    return sorted(found - daemons)


def _students() -> list[str]:
    """A small class with at least one student in each shard; shard 2's first student is slow."""
    chosen: dict[int, list[str]] = {}
    for n in range(100):
        name = f"student-{n:02d}"
        shard = provenance.shard_of(name, SHARDS)
        if len(chosen.setdefault(shard, [])) < 2:
            chosen[shard].append(name)
        if all(len(chosen.get(k, [])) == 2 for k in range(1, SHARDS + 1)):
            break
    return sorted(name for names in chosen.values() for name in names)


def _write_class(submitted: Path) -> str:
    students = _students()
    slow = min(name for name in students if provenance.shard_of(name, SHARDS) == 2)
    for n, student in enumerate(students):
        sdpa = {SDPA: (SLOW_CELL if student == slow else "") + answer("sdpa", SDPA)}
        if n % 3 == 1:  # some wrong answers: a grade recorded as 0 by mistake must show
            sdpa[SDPA] += "\n_right = scaled_dot_product_attention\n" \
                          "def scaled_dot_product_attention(q, k, v, mask=None):\n" \
                          "    out, weights = _right(q, k, v, mask)\n    return out * 2, weights\n"
        write(learner_notebook("sdpa", sdpa), submitted / student / "attention" / "sdpa.ipynb")
        write(learner_notebook("mha", blank=n % 3 == 2), submitted / student / "attention" / "mha.ipynb")
    return slow


def _header_commands() -> tuple[str, str]:
    """The recipe's header, as it is written: the array's submission, and the merge's."""
    lines = [line.removeprefix("#   ") for line in RECIPE.read_text().splitlines() if line.startswith("#   ")]
    commands = "\n".join(line for line in lines if not line.startswith("export AUTOGRADE_SEED"))
    assert "submitted=submitted out=grades shards=8" in commands, commands
    array, merge = commands.split("sbatch --dependency")
    return array, "sbatch --dependency" + merge


def _submit(cluster: Cluster, submitted: Path, out: Path, array: str | None = None) -> tuple[str, str]:
    """The header's commands, with this class, folder and shard count: (the array's id, the merge's);
    with `array`, the merge's alone, after that array."""
    submit, merge = _header_commands()
    given = f"submitted={submitted} out={out} shards={SHARDS}"
    commands = submit.replace("submitted=submitted out=grades shards=8", given) + merge if array is None \
        else f"{given} jid={array}\n{merge}"
    ran = cluster.run("bash", "-euc", commands + '\necho "array $jid"', AUTOGRADE_SEED=str(SEED),
                      PYTHON=sys.executable)
    return (re.search(r"^array (\d+)$", ran.stdout, re.M).group(1),
            re.search(r"Submitted batch job (\d+)", ran.stdout).group(1))


def _recorded(out: Path) -> list[str]:
    with sqlite3.connect(f"file:{out / journal.FILE}?mode=ro", uri=True) as db:
        return [student for student, in db.execute("select student from grades")]


def _same_outputs(merged: Path, whole: Path) -> None:
    for name in OUTPUTS:
        assert (merged / name).read_bytes() == (whole / name).read_bytes(), name
    names = sorted(p.name for p in (whole / "feedback").iterdir())
    assert sorted(p.name for p in (merged / "feedback").iterdir()) == names
    for path in (whole / "feedback").iterdir():
        assert (merged / "feedback" / path.name).read_bytes() == path.read_bytes(), path.name
    assert without_timings(merged / "report.html") == without_timings(whole / "report.html")


@pytest.fixture()
def cluster(tmp_path_factory):
    _installed()
    folder = tmp_path_factory.mktemp("slurm")
    folder.chmod(0o700)
    cluster = Cluster(folder)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_the_recipe_on_a_real_slurm_merges_to_one_run_and_a_requeued_task_changes_no_grade(cluster, tmp_path):
    submitted, whole, out = tmp_path / "submitted", tmp_path / "whole", tmp_path / "grades"
    slow = _write_class(submitted)
    groups_before = submission_groups()
    single = subprocess.run([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(whole),
                             "--seed", str(SEED), "--jobs", "2"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]

    array, merge = _submit(cluster, submitted, out)
    assert cluster.wait_until_done(merge) == "COMPLETED", (out / f"autograde-merge-{merge}.log").read_text()
    tasks = {job: state for job, state in cluster.jobs().items() if job.startswith(f"{array}_")}
    assert tasks == {f"{array}_{k}": "COMPLETED" for k in range(1, SHARDS + 1)}, tasks
    assert {p.name for p in out.glob("autograde-*.log")} == \
        {f"autograde-{array}_{k}.log" for k in range(1, SHARDS + 1)} | {f"autograde-merge-{merge}.log"}
    _same_outputs(out / "class", whole)

    # Shard 2 graded again from nothing, requeued while its first notebook (a slow one) is graded.
    shutil.rmtree(out / "shard-2")
    # A group made from now on, by a fork server below this process: the rerun's first notebook. Groups made
    # before, such as those of this test session's own fork server (a descendant too), do not count.
    groups_then = set(submission_groups())
    rerun = cluster.run("sbatch", "--parsable", "--array=2", f"--output={out}/autograde-%A_%a.log", str(RECIPE),
                        str(submitted), str(out), SHARDS=str(SHARDS), AUTOGRADE_SEED=str(SEED),
                        PYTHON=sys.executable).stdout.strip()
    deadline = time.monotonic() + 300
    while not {server for group, server in submission_groups().items() if group not in groups_then} & \
            set(descendants(os.getpid())):  # a notebook in its sandbox
        assert time.monotonic() < deadline, (out / f"autograde-{rerun}_2.log").read_text(errors="replace")
        time.sleep(0.2)
    cluster.requeue(f"{rerun}_2")
    deadline = time.monotonic() + 120
    while cluster.jobs().get(f"{rerun}_2") not in ("PENDING", None):
        assert time.monotonic() < deadline, cluster.jobs()
        time.sleep(0.5)
    recorded = _recorded(out / "shard-2")
    assert slow not in recorded  # stopped mid-notebook: not recorded, neither as crashed nor as 0
    # A requeued job waits a while before it may start again; started at once, it must not start in
    # the second its first run was killed: slurmd compares a job's credentials with the time it
    # revoked them to the second, and refuses a launch in that second ("Job credential revoked").
    time.sleep(1.1)
    cluster.run("scontrol", "update", f"jobid={rerun}_2", "starttime=now", check=False)
    assert cluster.wait_until_done(f"{rerun}_2") == "COMPLETED"
    log = (out / f"autograde-{rerun}_2.log").read_text(errors="replace")
    first, interrupted, second = log.partition("interrupted by SIGTERM")  # both attempts, in one log
    assert interrupted and "isolation: " in second and "isolation: " not in first, log[-3000:]

    _, merged_again = _submit(cluster, submitted, out, array=rerun)  # the same merge, submitted again
    assert cluster.wait_until_done(merged_again) == "COMPLETED"
    _same_outputs(out / "class", whole)
    assert groups_left(groups_before) == []  # every fork server removed its groups, however its task ended
