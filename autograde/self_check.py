"""Checks inside the learner's notebook: the tests run on the notebook's own functions.

`check("sdpa")` runs the visible tests and prints what is wrong; `run_in_process` is also
what the nbgrader test cells call (`autograde.nbgrader_tests`). Unlike the instructor's
grader, this runs in the learner's own kernel: no sandbox is needed, the code is theirs.
"""

from __future__ import annotations

import inspect

from autograde import exercises, forbidden, reference
from autograde.cases import Case, Exercise, build_inputs
from autograde.compare import CaseResult, compare
from autograde.observe import run_probe
from autograde.report import check_text


def history_cells(namespace: dict) -> list[tuple[str, str]]:
    """The cells run so far in this Jupyter kernel (IPython keeps them in `In`), for the static scan."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return []
    return [(f"In [{number}]", source) for number, source in enumerate(history) if isinstance(source, str)]


def run_in_process(exercise: Exercise, cases: list[Case], namespace: dict,
                   hidden_seed: int | None) -> tuple[list[CaseResult], list[forbidden.Violation]]:
    violations = forbidden.scan(history_cells(namespace), exercise.not_allowed)
    tripwire = forbidden.Tripwire(exercise.not_allowed)
    results = []
    for case in cases:
        inputs = build_inputs(exercise, case, hidden_seed)
        expected = reference.expected(exercise, case, inputs)
        with tripwire:
            got = run_probe(case.probe, namespace, inputs)
        results.append(compare(case, inputs, expected, got))
    found = {v.name for v in violations}
    return results, violations + [v for v in tripwire.violations if v.name not in found]


def check(exercise_id: str, function: str | None = None, namespace: dict | None = None) -> None:
    """Run the visible tests of `exercise_id` (only those using `function`, if given) and print the results.

    The functions come from `namespace`, by default the globals of the caller (the notebook).
    """
    if namespace is None:
        namespace = inspect.currentframe().f_back.f_globals
    exercise = exercises.get(exercise_id)
    cases = [case for case in exercise.cases if case.visible and (function is None or function in case.uses)]
    if not cases:
        raise ValueError(f"no visible test of {exercise_id!r} uses {function!r}; "
                         f"the names are {', '.join(exercise.required)}")
    results, violations = run_in_process(exercise, cases, namespace, hidden_seed=None)
    hidden = sum(case.points for case in exercise.cases if not case.visible) if function is None else 0
    print(check_text(exercise_id, results, violations, hidden))
