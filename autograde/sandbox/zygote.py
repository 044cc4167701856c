"""One warm interpreter per run from which each fork server is forked: torch imported once, not once
per grading process.

Started by `client.start_zygote` before the run's own imports (they then take a core each), with
the environment that every fork server of the run shares (`client.scrubbed_environment`, the GPU's
variables), and `python -I`, as a fork server alone is. It imports numpy and torch, which read
nothing else of a server's environment, and nothing of any submission; it computes nothing.

Each request on its socket (SOCK_SEQPACKET; the descriptor of its end is an argument; the other end
is held by the run's own processes only) is one message: a JSON object of the server's own
variables (what the exercises need set before triton loads; a delegated cgroup), with the server's
stdin, stdout and stderr as descriptors; a message without them (`client.zygote_load_servers`, sent
as soon as the run has imported the exercises) holds the exercises' variables alone. At the first
message, the zygote sets its variables and imports the server's modules, triton among them (0.3 s
that each server paid after its fork); every server of a run is asked for with the same exercises'
variables, and one that was not would be started afresh. The zygote forks; the child, in a session
of its own, takes those as 0, 1 and 2 and becomes a fork server (`server.serve`), as if it had been
started alone. A server ends when its requests close: when its grading process ends, however it
ends. The zygote dies with the run's process; once every holder of the socket's other end has
closed it, it waits for its servers (so that their CPU time counts as the run's children's) and
ends.
"""

import contextlib
import json
import os
import socket
import sys
import traceback

import numpy  # noqa: F401
import numpy.random  # noqa: F401
import torch  # noqa: F401

from autograde.sandbox import isolation
from autograde.sandbox.client import ROOT, START_SERVER

_SHARED_ENVIRONMENT = dict(os.environ)  # what the run started it with, before any request's variables

DESCRIPTORS = 3  # the server's stdin, stdout and stderr


def _load_server(message: bytes) -> dict[str, str]:
    """The server's modules, with the message's variables set (triton reads them as it loads); those
    variables. Where that fails, each server fails to import them again, and says why on its stderr."""
    variables = json.loads(message)
    os.environ.update(variables)
    with contextlib.suppress(Exception):
        import autograde.sandbox.server  # noqa: F401
    return variables


def _become_server(requests: socket.socket, variables: dict[str, str], descriptors: list[int],
                   loaded: dict[str, str]) -> None:
    """Where the request's `variables` differ from those the server's modules were `loaded` with, a
    new interpreter is started in this process's place, as a server started alone is."""
    requests.close()
    os.setsid()
    for target, descriptor in enumerate(descriptors):
        os.dup2(descriptor, target)
        os.close(descriptor)
    try:
        if any(variables.get(name) != value for name, value in loaded.items()):
            os.execve(sys.executable, [sys.executable, "-I", "-c", START_SERVER, str(ROOT)],
                      {**_SHARED_ENVIRONMENT, **variables})
        os.environ.update(variables)
        from autograde.sandbox.server import serve

        serve()
    except BaseException:  # noqa: BLE001 - said on the server's stderr, which its grader reads
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(requests_descriptor: int) -> None:
    isolation.die_with_parent()
    requests = socket.socket(fileno=requests_descriptor)
    loaded = None  # the variables the server's modules were loaded with
    while True:
        message, descriptors, _, _ = socket.recv_fds(requests, 65536, DESCRIPTORS)
        if not message:  # every holder of the other end has closed it: the run is over
            break
        if loaded is None:
            loaded = _load_server(message)
        if len(descriptors) == DESCRIPTORS and os.fork() == 0:
            _become_server(requests, json.loads(message), descriptors, loaded)
        for descriptor in descriptors:
            os.close(descriptor)
        _reap(block=False)
    _reap(block=True)
    os._exit(0)
