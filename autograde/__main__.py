import atexit
import gc
import os
import sys

if __name__ == "__main__":
    gc.disable()  # while the command imports (a tenth of their time); see below

from autograde.grading import processes  # noqa: E402
from autograde.sandbox import client as sandbox  # noqa: E402

if __name__ == "__main__" and processes.will_grade(sys.argv[1:]):
    sandbox.start_zygote()  # the fork servers' imports, once for the run, beside this process's
    if processes.will_grade_in_processes(sys.argv[1:]):
        processes.without_blas_threads()  # one thread, so that the grading processes are forked from here
    sandbox.zygote_load_servers()  # with the exercises imported (torch, most of this process's imports)

from autograde.frontends.cli import main  # noqa: E402  (after the start above, on purpose)

if __name__ == "__main__":
    # What the imports made is left out of every later collection, here and in the grading processes
    # forked from here: collections walk only what the run makes, and leave inherited pages unwritten.
    gc.freeze()
    gc.enable()
    code = main()
    # Everything the command wrote is closed: atexit's handlers run (a fork server's close among them),
    # then the interpreter's teardown, most of a second of torch's and triton's modules, is skipped.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
