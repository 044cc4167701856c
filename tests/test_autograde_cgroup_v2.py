"""The grader's control groups under cgroup v2, where this machine's kernel mounts version 1.

Two tests depend on the version: a submission's tree bounded as a whole by the group root makes
for it (`test_autograde_sandbox.py`, which runs here under version 1 as well), and a group
delegated to an instructor without root (`test_autograde_unprivileged.py`: delegation exists
only in version 2). Where this machine has version 1, they run again in a virtual machine:
Debian's kernel booted by virtme-ng on this machine's own files (read-only but for one folder),
whose `/sys/fs/cgroup` is version 2 with every controller. QEMU emulates the CPU (TCG), about
ten times slower: KVM inside this machine, itself a VM, hangs before the kernel prints a line.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from autograde.sandbox.cgroups import CGROUPS
from tests import debian_packages
from tests.fixtures.notebooks import ROOT

pytestmark = [
    pytest.mark.vm,
    pytest.mark.timeout(1800),
    pytest.mark.skipif((CGROUPS / "cgroup.controllers").exists(),
                       reason="this machine's cgroups are version 2: the tests below run here directly"),
    pytest.mark.skipif(os.getuid() != 0, reason="needs root: the tests below do, and so does the kernel's image"),
]

VERSION_2_TESTS = [
    "tests/test_autograde_sandbox.py::test_the_memory_limit_holds_for_the_whole_process_tree",
    "tests/test_autograde_unprivileged.py::test_a_delegated_control_group_bounds_each_submissions_tree_without_root",
]
# What virtme-ng needs besides itself (a dependency of the course's tests): QEMU, a static
# busybox for its initramfs, and a kernel with its modules (9p, virtio).
VM_PACKAGES = {"qemu-system-x86": Path("/usr/bin/qemu-system-x86_64"), "busybox-static": Path("/bin/busybox")}

# Run inside: say it booted, then the tests without pytest-timeout (the emulated CPU is slow: this
# test's own limit bounds them all; their marks, unknown then, are not worth a warning). Output
# goes only into the folder shared writable.
INSIDE = """
echo booted > "$OUT/booted"
cat /proc/self/mounts | grep cgroup > "$OUT/cgroups"
cd "$COURSE" || exit 1
PYTHONDONTWRITEBYTECODE=1 "$PYTHON" -m pytest -o addopts= -p no:timeout -p no:cacheprovider -q -rA \\
    -W ignore::pytest.PytestUnknownMarkWarning \\
    --junitxml="$OUT/junit.xml" "$@" > "$OUT/pytest.log" 2>&1
"""


def _kernel() -> Path:
    """The newest of Debian's kernels in /boot, installed with its modules if there is none."""
    def newest() -> Path | None:
        return max(Path("/boot").glob("vmlinuz-*"), key=lambda path: path.stat().st_mtime, default=None)

    missing = [package for package, installed in VM_PACKAGES.items() if not installed.exists()]
    if missing or newest() is None:
        debian_packages.install(missing + ["linux-image-amd64"] * (newest() is None))
    kernel = newest()
    assert kernel is not None, "apt-get installed linux-image-amd64, but /boot has no vmlinuz-*"
    return kernel


def test_the_tests_that_need_cgroup_v2_pass_in_a_virtual_machine_that_has_it(tmp_path: Path):
    vng = Path(sys.executable).parent / "vng"
    assert vng.exists(), f"virtme-ng is one of the course's test dependencies: {vng} is missing"
    kernel = _kernel()
    out = tmp_path / "shared"
    out.mkdir()
    settings = {"OUT": out, "COURSE": ROOT, "PYTHON": sys.executable}  # virtme-ng passes no environment in
    (out / "inside.sh").write_text("".join(f"{name}={shlex.quote(str(value))}\n" for name, value in settings.items())
                                   + INSIDE)
    environment = {**os.environ, "PATH": f"{vng.parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}
    # A session of its own, killed as a whole however the test ends: QEMU is virtme-ng's child, and a
    # time-out of virtme-ng alone would leave it running with its 12 GiB.
    vm = subprocess.Popen(
        [str(vng), "--disable-kvm", "--run", str(kernel), "--memory", "12G", "--cpus", "2", "--rwdir", str(out),
         "--", "sh", str(out / "inside.sh"), *VERSION_2_TESTS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT,
        start_new_session=True)
    try:
        stdout, stderr = vm.communicate(timeout=1700)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(vm.pid, signal.SIGKILL)
        vm.wait()
    assert (out / "booted").exists(), f"the virtual machine did not boot {kernel.name}:\n{stderr[-3000:]}"
    assert "cgroup2 /sys/fs/cgroup " in (out / "cgroups").read_text(), (out / "cgroups").read_text()
    log = (out / "pytest.log").read_text() if (out / "pytest.log").exists() else stdout[-3000:]
    assert (out / "junit.xml").exists(), log[-5000:]
    outcomes = {}
    for case in ElementTree.parse(out / "junit.xml").getroot().iter("testcase"):
        ended = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{case.get('classname')}.{case.get('name')}"] = ended[0] if ended else "passed"
    expected = {test.replace(".py::", ".").replace("/", "."): "passed" for test in VERSION_2_TESTS}
    assert outcomes == expected, log[-5000:]
