"""The course's autograder: exercise definitions, in-notebook checks, and the instructor's grader.

In a notebook: `from autograde import check; check("sdpa")`. For instructors:
`python -m autograde release` and `python -m autograde grade <submitted> --out <dir>`
(see autograde/README.md).
"""

from autograde.frontends.check import check

__all__ = ["check"]
