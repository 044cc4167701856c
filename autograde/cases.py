"""The vocabulary of the exercise definitions: exercises, test cases, their inputs and seeds.

An exercise is data: where its notebook is, the names it must define, the functions it may
not call. It is defined in `autograde/exercises/<id>.py`, with the calls its tests make on a
submission; its tests are a pytest module, `autograde/tests/test_<id>.py`, which draws its
inputs with `Draw` from a seed (`test_seed`) and passes them around as `Inputs`.
"""

from __future__ import annotations

import hashlib
import hmac
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

# Tolerance on the largest absolute error, relative to max(1, largest expected magnitude).
TOLERANCE = {"torch.float64": 1e-10, "torch.float32": 1e-5, "torch.float16": 2e-3, "torch.bfloat16": 2e-2}

# The contract's names first, then the same functions under other names (a private alias, a
# module that re-exports them, PyTorch's own attention kernels), which a learner could call
# instead. `sandbox.tripwire.Tripwire` also stops the operators underneath, whatever calls them.
NOT_ALLOWED_ATTENTION = (
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.MultiheadAttention.forward",
    "torch._native_multi_head_attention",
    "torch.nn.attention.flex_attention.flex_attention",
)
NOT_ALLOWED_SOFTMAX = (
    "torch.softmax",
    "torch.nn.functional.softmax",
    "torch.Tensor.softmax",
    "torch.logsumexp",
    "torch.Tensor.logsumexp",
    "torch.nn.functional.log_softmax",
    "torch.Tensor.log_softmax",
    "torch.log_softmax",
    "torch._softmax",
    "torch._log_softmax",
    "torch.special.softmax",
    "torch.special.log_softmax",
    "torch.special.logsumexp",
    "torch.nn.functional.softmin",
)


FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def alternate_dtypes(table: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """A parametrised test's product of axes (case id -> its values), each case in float32 or float64
    (last in its id and values) instead of both: half the calls, and still every value of every axis
    meets both dtypes, since the dtype alternates with the sum of the case's positions on its axes."""
    axes = [list(dict.fromkeys(values)) for values in zip(*table.values())]
    cases = {}
    for case, values in table.items():
        dtype = list(FLOAT_DTYPES)[sum(axis.index(value) for axis, value in zip(axes, values)) % 2]
        cases[f"{case}, {dtype}"] = (*values, dtype)
    for position, axis in enumerate(axes):
        for value in axis:
            met = {values[-1] for values in cases.values() if values[position] == value}
            if met != set(FLOAT_DTYPES):
                raise ValueError(f"{value!r} meets {sorted(met)} only: the table is not a product of two axes or more")
    return cases


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
        """The inputs in one line; parameter tensors (`*weight`, `*bias`) are left to the note, and
        lists of names (which of its results a test reads, e.g. `["", "_neg"]`) are the test's own."""
        parts = []
        for key, value in self.values.items():
            if isinstance(value, torch.Tensor) and key.endswith(("weight", "bias")):
                continue
            if isinstance(value, (list, tuple)) and value and all(isinstance(item, str) for item in value):
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
        # Drawn in float32 and then cast, so the float32 and float64 variants hold the same values
        # (float16's rounded); torch's generator draws float32 about six times as fast as float64.
        return (scale * torch.randn(shape, generator=self.generator, dtype=torch.float32)).to(dtype)

    def bernoulli(self, *shape: int, p: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=torch.float64) < p

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high], both ends included."""
        return self.py.randint(low, high)

    def choice(self, options):
        return self.py.choice(list(options))


# Compared and hashed by identity: each exercise exists once, in the registry.
@dataclass(frozen=True, eq=False)
class Exercise:
    """What the tests of an exercise need to know beyond the tests: its place, its names, its rules."""

    id: str
    assignment: str
    title: str
    required: tuple[str, ...]
    not_allowed: tuple[str, ...]
    # Extra environment for the worker process (e.g. TRITON_INTERPRET for Triton on the CPU).
    env: Mapping[str, str] = field(default_factory=dict)
    # Whether its worker may reach the machine's CUDA GPU: only an exercise that runs kernels
    # there (a GPU's memory is beyond the sandbox's limits; THREAT_MODEL.md, "GPUs").
    gpu: bool = False
    # Whether rules are measured by torch's modes in the learner's process (`autograde.rules`): code
    # that computes outside torch (numpy) escapes them, so the review scan shows it to a person.
    rules_in_process: bool = False

    @property
    def notebook(self) -> str:
        """Path of the notebook relative to `solutions/`, `exercises/` and a student folder."""
        return f"{self.assignment}/{self.id}.ipynb"


def float_copy(value: Any, dtype: torch.dtype = torch.float64) -> Any:
    """`value` with every floating-point tensor (in Inputs, dicts, lists and tuples too) copied as `dtype`."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return value
        return value.detach().to(dtype).requires_grad_(value.requires_grad)
    if isinstance(value, Inputs):
        return value.cast(dtype)
    if isinstance(value, dict):
        return {key: float_copy(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(float_copy(item, dtype) for item in value)
    return value


def submission_seed(secret: int, submitter: str) -> int:
    """The hidden tests' seed for one submitter: an HMAC of their name keyed by the instructor's
    secret seed. Classmates draw different hidden inputs, so that one student's tell nothing of
    another's; a regrade draws the same; without the secret none can be reproduced."""
    digest = hmac.new(str(secret).encode(), submitter.encode("utf-8", "surrogateescape"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little")


def submitter_of(notebook: Path) -> str:
    """Who handed a notebook in, from the layout `<submitter>/<assignment>/<notebook>` that the
    grader's `submitted/` folder and nbgrader's share (nbgrader runs it in `<submitter>/<assignment>/`)."""
    return notebook.absolute().parent.parent.name


def test_seed(exercise_id: str, test_name: str, hidden_seed: int | None) -> int:
    """Visible tests draw from a fixed seed; hidden ones from the instructor's seed."""
    key = f"{exercise_id}/{test_name}" if hidden_seed is None else f"{hidden_seed}/{exercise_id}/{test_name}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
