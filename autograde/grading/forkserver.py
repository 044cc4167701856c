"""What multiprocessing's forkserver imports as it starts (`processes.PRELOADED`), and only it.

Everything a grading process needs, imported once, and one more thing: the forkserver dies with
the run's process that started it. Each grading process it forks dies with it in turn (`batch`),
and holds the pipe whose end would otherwise tell the forkserver that the run has gone: without
this, a run killed with SIGKILL would leave both waiting for each other. Imported anywhere else,
it would tie that process to its parent's life.
"""

from autograde.grading import batch  # noqa: F401  (imported here for the grading processes)
from autograde.sandbox import isolation

isolation.die_with_parent()
