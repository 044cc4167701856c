"""The nbgrader test cells' entry point: one test of the exercise, run in the notebook's kernel.

A test cell calls `run("sdpa", "no-mask", globals())`: it passes silently, or raises
AssertionError with what is wrong, which nbgrader counts as 0 points for the cell. Hidden
tests draw their inputs from the environment variable AUTOGRADE_SEED (the instructor's seed,
the same as `python -m autograde grade --seed`) and the student, whose folder nbgrader runs
the notebook in (`<student>/<assignment>/`), so that nbgrader and the grader agree.
As in the grader, a not-allowed call in any test of the exercise makes every test cell fail,
those before the test that made it too.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from autograde import registry
from autograde.cases import Exercise, submission_seed, submitter_of
from autograde.compare import total
from autograde.frontends.check import run_in_kernel
from autograde.grading.session import SEED_VARIABLE, catalogue, hidden_seed_from_environment
from autograde.submission import forbidden


def choose_seed(given: int | None) -> int:
    """The instructor's seed: the one given, else $AUTOGRADE_SEED, else a fresh random one."""
    if given is not None:
        return given
    if os.environ.get(SEED_VARIABLE):
        return int(os.environ[SEED_VARIABLE])
    return secrets.randbelow(2**32)


def graded_seed() -> int | None:
    """The hidden tests' seed when nbgrader grades: the instructor's, for the student whose folder this is."""
    secret = hidden_seed_from_environment()
    # nbgrader runs the notebook in its folder, `<student>/<assignment>/`: the notebook's name does not matter.
    return None if secret is None else submission_seed(secret, submitter_of(Path.cwd() / "notebook.ipynb"))


def hidden_seed() -> int:
    seed = graded_seed()
    if seed is not None:
        return seed
    seed = secrets.randbelow(2**32)
    print(f"{SEED_VARIABLE} is not set: hidden inputs drawn with seed {seed}")
    return seed


_swept: dict[tuple, list[forbidden.Violation]] = {}


def violations_in_any_test(exercise: Exercise, namespace: dict) -> list[forbidden.Violation]:
    """The tripwire over every test of the exercise, once for each definition of its functions."""
    key = (exercise.id, tuple(id(namespace.get(name)) for name in exercise.required))
    if key not in _swept:
        # Grading (a seed is set): every test. A learner running the notebook: the visible ones.
        seed = graded_seed()
        _, violations, _ = run_in_kernel(exercise, namespace, seed, visible_only=seed is None)
        _swept[key] = violations
    return _swept[key]


def test_function(test_name: str) -> str:
    """The test function of a test's report name: `no-mask` -> `test_no_mask`."""
    return "test_" + test_name.replace("-", "_")


def run(exercise_id: str, test_name: str, namespace: dict) -> float | None:
    """One test (all its parametrised cases): passes, or raises AssertionError with what is wrong.

    When only some cases of a parametrised test fail, the points of those that passed are the
    cell's value, which nbgrader takes as partial credit, as the grader gives it."""
    exercise = registry.get(exercise_id)
    hidden = any(not test.visible for test in catalogue(exercise) if test.name.split("[")[0] == test_name)
    results, violations, _ = run_in_kernel(exercise, namespace, hidden_seed() if hidden else None,
                                           test_function(test_name))
    found = {v.name for v in violations}
    violations += [v for v in violations_in_any_test(exercise, namespace) if v.name not in found]
    if violations:
        raise AssertionError("; ".join(v.describe() for v in violations)
                             + f": not allowed in {exercise_id}, so every test scores 0")
    if not results:
        raise AssertionError(f"{exercise_id} has no test {test_name!r}")
    failed = [result for result in results if not result.passed]
    if not failed:
        print(f"test {test_name} passed")
        return None
    if not failed[0].visible:
        report = [f"hidden test {result.name} failed" for result in failed]
    else:
        report = [line for result in failed
                  for line in [f"test {result.name} failed", f"inputs: {result.inputs}", *result.problems]]
    if len(failed) == len(results):
        raise AssertionError("\n".join(report))
    print("\n".join(report))
    return total(result.points for result in results if result.passed)
