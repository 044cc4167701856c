"""The vocabulary of the exercise definitions: exercises, test cases, their inputs and seeds.

An exercise is data: the names a notebook must define, the functions it may not call, and
its test cases. A test case builds its inputs from a seed (`build`) and makes its calls on a
namespace (`probe`): the same probe runs on the learner's functions (in the worker process,
or in the learner's own kernel for `check`) and on the reference solution (in the trusted
process, in float64), and `compare` holds the two results side by side.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

# Tolerance on the largest absolute error, relative to max(1, largest expected magnitude).
TOLERANCE = {"torch.float64": 1e-10, "torch.float32": 1e-5, "torch.float16": 2e-3, "torch.bfloat16": 2e-2}

NOT_ALLOWED_ATTENTION = (
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.MultiheadAttention.forward",
)
NOT_ALLOWED_SOFTMAX = (
    "torch.softmax",
    "torch.nn.functional.softmax",
    "torch.Tensor.softmax",
    "torch.logsumexp",
    "torch.Tensor.logsumexp",
    "torch.nn.functional.log_softmax",
)


@dataclass(frozen=True)
class Inputs:
    """What a test case feeds the functions: tensors and plain values, and a note on them."""

    values: Mapping[str, Any]
    note: str = ""

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def first_tensor(self) -> torch.Tensor | None:
        return next((v for v in self.values.values() if isinstance(v, torch.Tensor)), None)

    def cast(self, dtype: torch.dtype) -> "Inputs":
        """The same inputs with every floating-point tensor cast to `dtype` (for the reference)."""
        return Inputs(
            {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in self.values.items()},
            self.note,
        )

    def describe(self) -> str:
        """The inputs in one line; parameter tensors (`*weight`, `*bias`) are left to the note."""
        parts = []
        for key, value in self.values.items():
            if isinstance(value, torch.Tensor) and key.endswith(("weight", "bias")):
                continue
            if isinstance(value, torch.Tensor):
                dtype = str(value.dtype).removeprefix("torch.")
                parts.append(f"{key} {tuple(value.shape)} {dtype}")
            else:
                parts.append(f"{key}={value!r}")
        text = ", ".join(parts)
        return f"{text}; {self.note}" if self.note else text


class Draw:
    """Seeded random inputs: tensors from a torch generator, sizes and choices from `random`."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.py = random.Random(seed)

    def normal(self, *shape: int, dtype: torch.dtype = torch.float64, scale: float = 1.0) -> torch.Tensor:
        # Drawn in float64 and then cast, so the float32 and float64 variants hold the same values.
        return (scale * torch.randn(shape, generator=self.generator, dtype=torch.float64)).to(dtype)

    def bernoulli(self, *shape: int, p: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=torch.float64) < p

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high], both ends included."""
        return self.py.randint(low, high)

    def choice(self, options):
        return self.py.choice(list(options))


@dataclass(frozen=True)
class Rule:
    """A rule on how a result is computed, which equal values cannot show (memory, work, ...).

    The probe reports what the rule needs as observations named in `keys`; `compare` does not
    hold those against the reference's but calls `judge(expected, got)`, which returns the
    problems found, each naming the rule and saying by how much it is broken. Limits are read
    from `expected`: the same probe computes them from the inputs on the reference's side.
    """

    name: str
    keys: tuple[str, ...]
    judge: Callable[[dict, dict], list[str]]


@dataclass(frozen=True)
class Case:
    """One test: inputs from `build(draw)`, outputs from `probe(functions, inputs)`.

    `probe` returns a flat dict: names that say what was computed (they appear in feedback)
    mapped to tensors or plain values (bool, int, float, str, None).
    """

    name: str
    points: float
    visible: bool
    about: str
    uses: tuple[str, ...]
    build: Callable[[Draw], Inputs]
    probe: Callable[[Any, Inputs], dict]
    seconds: float = 20.0
    # Rules on how the result is computed (memory, work, ...), judged rather than compared.
    rules: tuple[Rule, ...] = ()


# Compared and hashed by identity: each exercise exists once, in its module.
@dataclass(frozen=True, eq=False)
class Exercise:
    id: str
    assignment: str
    title: str
    required: tuple[str, ...]
    not_allowed: tuple[str, ...]
    cases: tuple[Case, ...]
    # Extra environment for the worker process (e.g. TRITON_INTERPRET for Triton on the CPU).
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        names = [case.name for case in self.cases]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.id}: test case names repeat: {names}")

    @property
    def notebook(self) -> str:
        """Path of the notebook relative to `solutions/`, `exercises/` and a student folder."""
        return f"{self.assignment}/{self.id}.ipynb"

    @property
    def max_score(self) -> float:
        return sum(case.points for case in self.cases)

    def case(self, name: str) -> Case:
        for case in self.cases:
            if case.name == name:
                return case
        raise KeyError(f"exercise {self.id!r} has no test case {name!r}")


def case_seed(exercise_id: str, case_name: str, hidden_seed: int | None) -> int:
    """Visible cases draw from a fixed seed; hidden ones from the instructor's seed."""
    key = f"{exercise_id}/{case_name}" if hidden_seed is None else f"{hidden_seed}/{exercise_id}/{case_name}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def build_inputs(exercise: Exercise, case: Case, hidden_seed: int | None) -> Inputs:
    if not case.visible and hidden_seed is None:
        raise ValueError(f"hidden case {case.name!r} needs the instructor's seed")
    return case.build(Draw(case_seed(exercise.id, case.name, None if case.visible else hidden_seed)))
