"""Checks inside the learner's notebook: the exercise's tests on the notebook's own functions.

`check("sdpa")` runs the visible tests with pytest, in the learner's kernel, and prints what
is wrong; `run_in_kernel` is also what the nbgrader test cells call (`autograde.frontends.nbgrader`).
Unlike the instructor's grader, this runs in the learner's own kernel: no sandbox is needed,
the code is theirs.
"""

from __future__ import annotations

import inspect

from autograde import registry
from autograde.cases import Exercise
from autograde.compare import CaseResult, total
from autograde.grading.local import LocalSubmission
from autograde.grading.report import check_text
from autograde.grading.session import Session, catalogue
from autograde.submission import forbidden


def history_cells(namespace: dict) -> list[tuple[str, str]]:
    """The cells run so far in this Jupyter kernel (IPython keeps them in `In`), for the static scan.

    Only what the exercise's functions reach counts, their latest definitions winning, as in
    the notebook that is handed in: a cell run once and deleted since changes nothing."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return []
    return [(f"In [{number}]", source) for number, source in enumerate(history) if isinstance(source, str)]


def run_in_kernel(exercise: Exercise, namespace: dict, hidden_seed: int | None, *selection: str,
                  visible_only: bool = False) -> tuple[list[CaseResult], list[forbidden.Violation], LocalSubmission]:
    """The tests (`selection`: test function names, default all) on the functions in `namespace`."""
    submission = LocalSubmission(exercise, namespace)
    session = Session(exercise, lambda: submission, hidden_seed, visible_only)
    session.reference()  # the expected values, found before any test: if missing, one error says what to do
    session.run(*selection)
    order = [test.name for test in catalogue(exercise)]
    results = sorted(session.results.values(), key=lambda result: order.index(result.name))
    violations, _ = forbidden.scan_graded(history_cells(namespace), exercise)
    found = {v.name for v in violations}
    return results, violations + [v for v in submission.violations if v.name not in found], submission


def check(exercise_id: str, function: str | None = None, namespace: dict | None = None) -> None:
    """Run the visible tests of `exercise_id` (only those using `function`, if given) and print the results.

    The functions come from `namespace`, by default the globals of the caller (the notebook).
    """
    if namespace is None:
        namespace = inspect.currentframe().f_back.f_globals
    exercise = registry.get(exercise_id)
    if function is not None and function not in exercise.required:
        raise ValueError(f"{exercise_id!r} has no function {function!r}; the names are {', '.join(exercise.required)}")
    results, violations, submission = run_in_kernel(exercise, namespace, None, visible_only=True)
    if function is not None:
        using = {test.name for test in catalogue(exercise) if function in test.uses}
        results = [r for r in results if r.name in using]
    hidden = total(test.points for test in catalogue(exercise) if not test.visible) if function is None else 0
    _, elsewhere = forbidden.scan_graded(history_cells(namespace), exercise)
    print(check_text(exercise_id, results, violations, hidden, elsewhere))
    for reason in submission.reviews:  # points kept; the grader's status will be `review`
        print(f"note for review: {reason}")
