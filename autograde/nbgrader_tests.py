"""The nbgrader test cells' entry point: one test case of the grader, run in the notebook's kernel.

A test cell calls `run("sdpa", "no-mask", globals())`: it passes silently, or raises
AssertionError with what is wrong, which nbgrader counts as 0 points for the cell. Hidden
cases draw their inputs from the environment variable AUTOGRADE_SEED (the instructor's seed,
the same as `python -m autograde grade --seed`), so that nbgrader and the grader agree.
As in the grader, a not-allowed call in any test of the exercise makes every test cell fail,
those before the test that made it too.
"""

from __future__ import annotations

import os
import secrets

from autograde import exercises, forbidden
from autograde.cases import Exercise, build_inputs
from autograde.observe import run_probe
from autograde.self_check import run_in_process

SEED_VARIABLE = "AUTOGRADE_SEED"


def choose_seed(given: int | None) -> int:
    """The instructor's seed: the one given, else $AUTOGRADE_SEED, else a fresh random one."""
    if given is not None:
        return given
    if os.environ.get(SEED_VARIABLE):
        return int(os.environ[SEED_VARIABLE])
    return secrets.randbelow(2**32)


def hidden_seed() -> int:
    value = os.environ.get(SEED_VARIABLE)
    if value is not None:
        return int(value)
    seed = secrets.randbelow(2**32)
    print(f"{SEED_VARIABLE} is not set: hidden inputs drawn with seed {seed}")
    return seed


_swept: dict[tuple, list[forbidden.Violation]] = {}


def violations_in_any_test(exercise: Exercise, namespace: dict) -> list[forbidden.Violation]:
    """The tripwire over every test of the exercise, once for each definition of its functions."""
    key = (exercise.id, tuple(id(namespace.get(name)) for name in exercise.required))
    if key not in _swept:
        tripwire, seed = forbidden.Tripwire(exercise.not_allowed), hidden_seed()
        for case in exercise.cases:
            inputs = build_inputs(exercise, case, None if case.visible else seed)
            with tripwire:
                run_probe(case.probe, namespace, inputs)
        _swept[key] = tripwire.violations
    return _swept[key]


def run(exercise_id: str, case_name: str, namespace: dict) -> None:
    exercise = exercises.get(exercise_id)
    case = exercise.case(case_name)
    [result], violations = run_in_process(exercise, [case], namespace, None if case.visible else hidden_seed())
    found = {v.name for v in violations}
    violations += [v for v in violations_in_any_test(exercise, namespace) if v.name not in found]
    if violations:
        raise AssertionError("; ".join(v.describe() for v in violations)
                             + f": not allowed in {exercise_id}, so every test scores 0")
    if not result.passed:
        if not case.visible:
            raise AssertionError(f"hidden test {case_name} failed")
        raise AssertionError("\n".join([f"test {case_name} failed", f"inputs: {result.inputs}", *result.problems]))
    print(f"test {case_name} passed")
