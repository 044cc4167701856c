"""Calls on a learner's functions, where the learner's code lives: an adapter of the exercise's
definition (`autograde/exercises/<id>.py`), or one of the exercise's functions by name. The worker
makes them on the notebook's namespace; `check()` makes them in the learner's own kernel."""

from __future__ import annotations

from typing import Any

from autograde import registry
from autograde.cases import Exercise
from autograde.observe import Submission


class UnknownCall(AttributeError):
    pass


def callable_names(exercise: Exercise) -> set[str]:
    return set(registry.adapters(exercise)) | set(exercise.required)


class LearnerCalls:
    def __init__(self, exercise: Exercise, namespace: dict):
        self.adapters = registry.adapters(exercise)
        self.required = exercise.required
        self.learner = Submission(namespace)

    def __call__(self, name: str, args: tuple | list, kwargs: dict) -> Any:
        if name in self.adapters:
            return self.adapters[name](self.learner, *args, **kwargs)
        if name in self.required:
            return getattr(self.learner, name)(*args, **kwargs)
        raise UnknownCall(f"{name!r} is neither an adapter of the tests nor a function of the exercise")
