"""The `submission` and `reference` fixtures' objects: a call by name, its result as observations.

Three kinds, from three trust domains, each in a module of its own: `sandboxed.SandboxedSubmission`
runs a notebook's cells in a sandboxed worker (`worker.py`, forked by the fork server) and sends it
each call over a Unix socket; arguments go out as `.npy` files, results come back as `.npy` files
and JSON, read header first (`wire.py`), never unpickled. `local.LocalSubmission` makes the same
calls on a namespace in this process: the learner's own kernel for `check()`.
`reference.Reference` makes them on the course's solution, in float64, in this process.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from autograde.cases import Exercise, Inputs
from autograde.observe import CallCost, Failure
from autograde.sandbox.calls import callable_names


class LearnerFailed(AssertionError):
    """The learner's call raised, ran out of time, or could not run: a failed test, with why."""

    def __init__(self, failure: Failure):
        super().__init__(failure.describe())
        self.failure = failure


def describe_arguments(args: tuple, kwargs: dict) -> str:
    parts = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, Inputs):
            parts.append(value.describe())
        elif isinstance(value, torch.Tensor):
            parts.append(f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}")
        elif isinstance(value, (dict, list, tuple)):
            parts.append(f"a {type(value).__name__} of {len(value)}")
        else:
            parts.append(repr(value))
    return ", ".join(parts)


class Proxy:
    """`proxy.name(*args, **kwargs)` -> `proxy.call(name, args, kwargs)`, for the exercise's names only."""

    def __init__(self, exercise: Exercise):
        self.exercise = exercise
        self.names = callable_names(exercise)
        self.seconds = 20.0  # the current test's limit for one call
        self.test = ""  # the current test's name
        self.log: list[str] = []  # the calls of the current test, described
        self.reviews: list[str] = []  # what the tests found for a person to look at (`for_review`)

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self.names:
            raise AttributeError(f"{type(self).__name__} of {self.exercise.id!r} has no call {name!r}; "
                                 f"the calls are {', '.join(sorted(self.names))}")
        return lambda *args, **kwargs: self.call(name, args, kwargs)

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    @contextlib.contextmanager
    def drawn_from(self, seed: int) -> Iterator[None]:
        """Within: the calls' inputs are drawn from `seed`, a hidden test's (`Reference` keeps their
        results only until another seed's come); nothing for the others."""
        yield

    def for_review(self, reason: str) -> None:
        """A test's finding that costs no points but asks for a person's look (the grade's status
        becomes `review`): code the contract allows that may go around a rule's intent."""
        if reason not in self.reviews:
            self.reviews.append(reason)

    def cost_measured(self, memory: bool = True) -> contextlib.AbstractContextManager[CallCost]:
        """`with proxy.cost_measured() as cost:` the calls inside raise the learner's memory by
        `cost.growth_bytes` and take `cost.cpu_seconds` of CPU time, once the block has ended;
        `memory=False`: the CPU time alone (`growth_bytes` None), for cases that time many calls."""
        raise NotImplementedError(f"{type(self).__name__} does not measure what calls cost")
