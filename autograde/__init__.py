"""The course's autograder: exercise definitions, in-notebook checks, and the instructor's grader.

In a notebook: `from autograde import check; check("sdpa")`. For instructors:
`python -m autograde release` and `python -m autograde grade <submitted> --out <dir>`
(see autograde/README.md).
"""

__all__ = ["check"]


def __getattr__(name: str):
    # Imported on first use, so that importing one layer (the fork server imports the sandbox)
    # does not load the front ends, grading and pytest above it.
    if name == "check":
        from autograde.frontends.check import check

        return check
    raise AttributeError(f"module 'autograde' has no attribute {name!r}")
