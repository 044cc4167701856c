"""What multiprocessing's forkserver imports as it starts (`processes.PRELOADED`), and only it.

Everything a grading process needs, imported once, and two more things. The forkserver dies with
the run's process that started it. Each grading process it forks dies with it in turn (`batch`),
and holds the pipe whose end would otherwise tell the forkserver that the run has gone: without
this, a run killed with SIGKILL would leave both waiting for each other. And it ends without the
interpreter's teardown: once the run closes that pipe (`processes.stop`, which waits for it), its
loop exits and atexit's handlers run first; the teardown of torch's and triton's modules after
them would take half a second of the run's end, for a process that holds nothing to write. The
processes it forks end in `os._exit` and never run atexit. Imported anywhere else, this module
would tie that process to its parent's life and cut its end short.
"""

import atexit
import os
import sys

from autograde.grading import batch  # noqa: F401  (imported here for the grading processes)
from autograde.sandbox import isolation


def _end_now() -> None:
    sys.stderr.flush()
    os._exit(0)


isolation.die_with_parent()
atexit.register(_end_now)  # registered after every import, so it runs before their handlers
