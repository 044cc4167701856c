"""The run's zygote (`autograde/sandbox/zygote.py`): each fork server of a run forked from one warm
interpreter grades as a server started alone does, ends when the process that asked for it ends,
however it ends, a request with other variables than the first gets a fresh interpreter, and where
the zygote has gone a server is started alone."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograde import registry
from autograde.grading.sandboxed import SandboxedSubmission
from autograde.grading.session import Session
from autograde.sandbox import client as sandbox
from autograde.submission import extract
from tests.fixtures.notebooks import ROOT, learner_notebook

pytestmark = [pytest.mark.xdist_group("autograde_sandbox"), pytest.mark.timeout(300)]

# A process of the run that asks the zygote for its fork server (given the socket's descriptor),
# says the server's pid, and waits to be killed.
ASKS_AND_WAITS = """
import socket, sys, time
from autograde.sandbox import client
client.use_zygote(socket.socket(fileno=int(sys.argv[1])))
print(client.ForkServer()._process.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def zygote():
    started = sandbox.Zygote()
    try:
        yield started
    finally:
        started.close()


def parent_session_state(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, session id, state) from /proc; None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return int(fields[1]), int(fields[3]), fields[0]


def ended(pid: int) -> bool:
    found = parent_session_state(pid)
    return found is None or found[2] in ("Z", "X")


# flash_triton: its variables (TRITON_INTERPRET here) are set in the zygote before it loads triton,
# from the run's early message (`zygote_load_servers`, as `python -m autograde grade` sends it) or
# from the first server's request.
@pytest.mark.parametrize("told_early", [True, False])
@pytest.mark.parametrize("exercise_id", ["sdpa", "flash_triton"])
def test_a_server_forked_by_the_zygote_grades_a_notebook_as_one_started_alone(zygote, monkeypatch, exercise_id,
                                                                             told_early):
    exercise = registry.get(exercise_id)
    cells = [(cell.number, cell.source) for cell in extract.code_cells(learner_notebook(exercise.id))]
    monkeypatch.setattr(sandbox, "_shared", None)  # this test's own server; the session's comes back after
    monkeypatch.setattr(sandbox, "_zygote_requests", zygote.requests)
    if told_early:
        sandbox.zygote_load_servers()
    session = Session(exercise, lambda: SandboxedSubmission(exercise, cells, sandbox.Limits(wall_seconds=60)),
                      hidden_seed=1)
    session.run()
    server = sandbox._shared
    try:
        parent, session_id, _ = parent_session_state(server._process.pid)
        assert (parent, session_id) == (zygote.process.pid, server._process.pid)  # its own session
        assert session.results and all(result.passed for result in session.results.values()), \
            [result.problems for result in session.results.values() if not result.passed]
    finally:
        server.close()
    assert ended(server._process.pid) and not server.alive


def test_a_request_with_other_variables_than_the_first_gets_a_fresh_server(zygote, monkeypatch):
    """The zygote loaded triton with the run's variables; a server asked for with others (here
    TRITON_INTERPRET changed) is a new interpreter (started as one alone is), which grades as one."""
    monkeypatch.setattr(sandbox, "_zygote_requests", zygote.requests)
    sandbox.zygote_load_servers()
    own = sandbox._own_environment()
    other = {**own, "TRITON_INTERPRET": "0" if own["TRITON_INTERPRET"] == "1" else "1"}
    monkeypatch.setattr(sandbox, "_own_environment", lambda: other)
    monkeypatch.setattr(sandbox, "_shared", None)  # this test's own server; the session's comes back after
    exercise = registry.get("sdpa")
    cells = [(cell.number, cell.source) for cell in extract.code_cells(learner_notebook(exercise.id))]
    session = Session(exercise, lambda: SandboxedSubmission(exercise, cells, sandbox.Limits(wall_seconds=60)),
                      hidden_seed=1)
    session.run()
    server = sandbox._shared
    try:
        command = Path(f"/proc/{server._process.pid}/cmdline").read_bytes().split(b"\0")
        assert sandbox.START_SERVER.encode() in command, command
        assert parent_session_state(server._process.pid)[0] == zygote.process.pid
        assert session.results and all(result.passed for result in session.results.values())
    finally:
        server.close()


def test_a_server_ends_with_the_process_that_asked_for_it_however_it_ends(zygote):
    asking = subprocess.Popen([sys.executable, "-c", ASKS_AND_WAITS, str(zygote.requests.fileno())],
                              pass_fds=(zygote.requests.fileno(),), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        server = int(asking.stdout.readline())
        assert parent_session_state(server)[0] == zygote.process.pid and not ended(server)
    finally:
        asking.kill()
        asking.wait()
    deadline = time.monotonic() + 20
    while not ended(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(server), "the server outlived the process whose requests it served"


def test_where_the_zygote_has_gone_a_server_is_started_alone(zygote, monkeypatch):
    zygote.process.kill()
    zygote.process.wait()
    monkeypatch.setattr(sandbox, "_zygote_requests", zygote.requests)
    server = sandbox.ForkServer()
    try:
        assert isinstance(server._process, subprocess.Popen) and server.alive
    finally:
        server.close()


def test_the_zygote_ends_once_the_run_closes_its_end_after_its_servers(zygote, monkeypatch):
    monkeypatch.setattr(sandbox, "_zygote_requests", zygote.requests)
    server = sandbox.ForkServer()
    server.close()
    zygote.close()
    assert zygote.process.returncode == 0 and ended(server._process.pid)

