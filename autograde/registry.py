"""The exercises: one definition each, `autograde/exercises/<id>.py`, defining `EXERCISE` and its
adapters, with its tests in `autograde/tests/test_<id>.py`.

Adding an exercise is adding those two modules (and its notebook); nothing here lists them but
`ORDER`, which places it in the course. Loading the registry runs the definitions only: the worker
needs their adapters, never the tests.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Callable

from autograde.adapters import adapters_of
from autograde.cases import Exercise

DEFINITIONS = Path(__file__).resolve().parent / "exercises"
TESTS = Path(__file__).resolve().parent / "tests"
# The course's order: the notebooks' order in the book. Exercises not listed come after, by name.
ORDER = ("sdpa", "mha", "gqa", "kv_cache", "rope", "mla", "flash_forward", "flash_backward", "flash_triton",
         "split_kv", "paged_kv", "window")


def _definitions() -> dict[str, ModuleType]:
    loaded = [importlib.import_module(f"autograde.exercises.{path.stem}")
              for path in sorted(DEFINITIONS.glob("*.py")) if path.stem != "__init__"]
    modules = {module.EXERCISE.id: module for module in loaded if hasattr(module, "EXERCISE")}
    if not modules:  # a package built without its definitions: say so, rather than know no exercise
        raise ImportError(f"no exercise definitions in {DEFINITIONS}")
    rank = {name: index for index, name in enumerate(ORDER)}
    return dict(sorted(modules.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


_DEFINITIONS = _definitions()
EXERCISES: dict[str, Exercise] = {exercise_id: module.EXERCISE for exercise_id, module in _DEFINITIONS.items()}


def get(exercise_id: str) -> Exercise:
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise KeyError(f"no exercise {exercise_id!r}; the exercises are {', '.join(EXERCISES)}") from None


def adapters(exercise: Exercise) -> dict[str, Callable]:
    """The calls its tests may make on a submission, by name (`autograde.adapters.adapter`)."""
    return adapters_of(_DEFINITIONS[exercise.id])


def test_file(exercise: Exercise) -> Path:
    return TESTS / f"test_{exercise.id}.py"
