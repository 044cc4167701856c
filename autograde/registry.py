"""The exercises: one pytest module each, `autograde/tests/test_<id>.py`, defining `EXERCISE`.

Adding an exercise is adding its test module (and its notebook); nothing here lists them.
The modules are loaded here under names of their own (`autograde_exercise_<id>`), so that
pytest, which imports them as `autograde.tests.test_<id>`, still rewrites their asserts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Callable

from autograde.cases import Exercise
from autograde.testing import adapters_of

TESTS = Path(__file__).resolve().parent / "tests"
# The course's order: the notebooks' order in the book. Exercises not listed come after, by name.
ORDER = ("sdpa", "mha", "gqa", "kv_cache", "rope", "mla", "flash_forward", "flash_backward", "flash_triton",
         "split_kv", "paged_kv", "window")


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"autograde_exercise_{path.stem.removeprefix('test_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _modules() -> dict[str, ModuleType]:
    loaded = [_load(path) for path in sorted(TESTS.glob("test_*.py"))]
    modules = {module.EXERCISE.id: module for module in loaded if hasattr(module, "EXERCISE")}
    rank = {name: index for index, name in enumerate(ORDER)}
    return dict(sorted(modules.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


_MODULES = _modules()
EXERCISES: dict[str, Exercise] = {exercise_id: module.EXERCISE for exercise_id, module in _MODULES.items()}


def get(exercise_id: str) -> Exercise:
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise KeyError(f"no exercise {exercise_id!r}; the exercises are {', '.join(EXERCISES)}") from None


def module(exercise: Exercise) -> ModuleType:
    """The exercise's test module, as loaded here (its helpers, e.g. for the course's own tests)."""
    return _MODULES[exercise.id]


def adapters(exercise: Exercise) -> dict[str, Callable]:
    """The calls its tests may make on a submission, by name (`autograde.testing.adapter`)."""
    return adapters_of(_MODULES[exercise.id])


def test_file(exercise: Exercise) -> Path:
    return TESTS / f"test_{exercise.id}.py"
