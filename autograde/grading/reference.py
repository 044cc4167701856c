"""The tests' `reference`: the course's solution, or an exercise's oracle, called in this process."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from autograde import solutions
from autograde.cases import Exercise, Inputs, float_copy
from autograde.grading.proxies import Proxy
from autograde.observe import failure_from, observe
from autograde.sandbox.calls import LearnerCalls
from autograde.testing import oracle_of


class Reference(Proxy):
    """The course's solution (`solutions/`), called in this process on float64 copies of the arguments;
    for an adapter with an oracle (`autograde.testing.oracle`), the oracle on the same copies.

    `recording`: also keep each result under `released_fingerprint` of its call, for `expected`."""

    def __init__(self, exercise: Exercise, recording: bool = False):
        super().__init__(exercise)
        self._calls = LearnerCalls(exercise, solutions.namespace(exercise))
        self._oracles = {name: found for name, function in self._calls.adapters.items()
                         if (found := oracle_of(function)) is not None}
        self._cache: dict[str, Any] = {}
        self.recorded: dict[str, Any] | None = {} if recording else None

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        args, kwargs = float_copy(args), float_copy(kwargs)
        key = call_fingerprint(name, args, kwargs)
        if key not in self._cache:
            try:
                result = self._oracles[name](*args, **kwargs) if name in self._oracles \
                    else self._calls(name, args, kwargs)
                self._cache[key] = observe(result)
            except Exception as exc:
                raise RuntimeError(f"the reference fails {self.exercise.id}: {name}: "
                                   f"{failure_from(exc).describe()}") from exc
        if self.recorded is not None:
            released = released_fingerprint(name, args, kwargs)
            if self.recorded.setdefault(released, self._cache[key]) is not self._cache[key]:
                raise RuntimeError(f"two calls of {name} differ only beyond float32's precision: "
                                   "their released expected values would be confused")
        return self._cache[key]


def released_fingerprint(name: str, args: tuple, kwargs: dict) -> str:
    """A call's fingerprint with its values rounded to float32: the same on a learner's machine, whose
    libm may draw the visible tests' float64 inputs a last bit apart from the release's."""
    return call_fingerprint(name, float_copy(args, torch.float32), float_copy(kwargs, torch.float32))


def call_fingerprint(name: str, *values: Any) -> str:
    digest = hashlib.sha256(name.encode())

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"T{value.dtype}{tuple(value.shape)}{value.requires_grad}".encode())
            digest.update(value.detach().contiguous().numpy().tobytes())
        elif isinstance(value, Inputs):
            digest.update(b"I" + value.note.encode())
            feed(dict(value.values))
        elif isinstance(value, dict):
            digest.update(b"D")
            for key, item in value.items():
                digest.update(repr(key).encode())
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            digest.update(repr(value).encode())

    for value in values:
        feed(value)
    return digest.hexdigest()
