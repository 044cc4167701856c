"""The registry of exercises: one module per exercise, each defining `EXERCISE`.

Adding an exercise: write `autograde/exercises/<id>.py` and list it in `_MODULES`.
"""

from __future__ import annotations

from autograde.cases import Exercise
from autograde.exercises import flash_backward, flash_forward, flash_triton, gqa, kv_cache, mha, sdpa

_MODULES = (sdpa, mha, gqa, kv_cache, flash_forward, flash_backward, flash_triton)
EXERCISES: dict[str, Exercise] = {module.EXERCISE.id: module.EXERCISE for module in _MODULES}


def get(exercise_id: str) -> Exercise:
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise KeyError(f"no exercise {exercise_id!r}; the exercises are {', '.join(EXERCISES)}") from None
