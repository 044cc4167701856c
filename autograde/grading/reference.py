"""The tests' `reference`: the course's solution, or an exercise's oracle, called in this process."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Iterator

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
        self._cache: dict[str, Any] = {}  # the visible tests' results: the same calls for every notebook
        self._drawn: tuple[int | None, dict[str, Any]] = (None, {})  # one submitter's hidden tests' results
        self._seed: int | None = None  # within `drawn_from`, the seed the calls' inputs come from
        self.recorded: dict[str, Any] | None = {} if recording else None

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        args, kwargs = float_copy(args), float_copy(kwargs)
        key = call_fingerprint(name, args, kwargs)
        cache = self._cache if self._seed is None or key in self._cache else self._drawn[1]
        if key not in cache:
            try:
                # looked up at the call: the tests' module marks its oracles when it is imported,
                # which may come after this reference was made (`check()` makes it first)
                by_oracle = oracle_of(self._calls.adapters.get(name))
                result = by_oracle(*args, **kwargs) if by_oracle else self._calls(name, args, kwargs)
                cache[key] = observe(result)
            except Exception as exc:
                raise RuntimeError(f"the reference fails {self.exercise.id}: {name}: "
                                   f"{failure_from(exc).describe()}") from exc
        if self.recorded is not None:
            released = released_fingerprint(name, args, kwargs)
            if self.recorded.setdefault(released, cache[key]) is not cache[key]:
                raise RuntimeError(f"two calls of {name} differ only beyond float32's precision: "
                                   "their released expected values would be confused")
        return cache[key]

    @contextlib.contextmanager
    def drawn_from(self, seed: int) -> Iterator[None]:
        """Within: the calls' inputs are drawn from `seed` (a hidden test's, one submitter's), and
        their results are kept only until calls come from another seed. A class's hidden inputs are
        never asked for again once their notebook is graded: kept for the process, they grew with
        the class (7.6 MiB a flash_forward notebook), and a long run's heap with them."""
        if self._drawn[0] != seed:
            self._drawn = (seed, {})
        self._seed = seed
        try:
            yield
        finally:
            self._seed = None


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
