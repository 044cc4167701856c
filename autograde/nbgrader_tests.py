"""The nbgrader test cells' entry point: one test case of the grader, run in the notebook's kernel.

A test cell calls `run("sdpa", "no-mask", globals())`: it passes silently, or raises
AssertionError with what is wrong, which nbgrader counts as 0 points for the cell. Hidden
cases draw their inputs from the environment variable AUTOGRADE_SEED (the instructor's seed,
the same as `python -m autograde grade --seed`), so that nbgrader and the grader agree.
"""

from __future__ import annotations

import os
import secrets

from autograde import exercises
from autograde.self_check import run_in_process

SEED_VARIABLE = "AUTOGRADE_SEED"


def hidden_seed() -> int:
    value = os.environ.get(SEED_VARIABLE)
    if value is not None:
        return int(value)
    seed = secrets.randbelow(2**32)
    print(f"{SEED_VARIABLE} is not set: hidden inputs drawn with seed {seed}")
    return seed


def run(exercise_id: str, case_name: str, namespace: dict) -> None:
    exercise = exercises.get(exercise_id)
    case = exercise.case(case_name)
    [result], violations = run_in_process(exercise, [case], namespace, None if case.visible else hidden_seed())
    if violations:
        raise AssertionError("; ".join(v.describe() for v in violations)
                             + f": not allowed in {exercise_id}, so every test scores 0")
    if not result.passed:
        if not case.visible:
            raise AssertionError(f"hidden test {case_name} failed")
        raise AssertionError("\n".join([f"test {case_name} failed", f"inputs: {result.inputs}", *result.problems]))
    print(f"test {case_name} passed")
