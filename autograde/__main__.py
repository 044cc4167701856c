import atexit
import os
import sys

from autograde.grading import processes
from autograde.sandbox import client as sandbox

if __name__ == "__main__" and processes.will_grade(sys.argv[1:]):
    # The fork servers' imports, once for the run, and the grading processes' beside this process's.
    sandbox.start_zygote()
    if processes.worth_starting_early(sys.argv[1:]):
        processes.start()

from autograde.frontends.cli import main  # noqa: E402  (after the start above, on purpose)

if __name__ == "__main__":
    code = main()
    # Everything the command wrote is closed: atexit's handlers run (a fork server's close among them),
    # then the interpreter's teardown, most of a second of torch's and triton's modules, is skipped.
    processes.stop()  # where it was started early for a run that needed none
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
