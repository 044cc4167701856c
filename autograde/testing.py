"""What an exercise's test module uses: seeded inputs, oracles, and assertions that say what differs.

An exercise's definition (`autograde/exercises/<id>.py`) holds its `Exercise` and the `@adapter`
functions that make calls on the learner's functions (`autograde.adapters`); its test module
(`autograde/tests/test_<id>.py`) holds plain pytest test functions and the inputs they draw. A
test gets three fixtures (`autograde/tests/conftest.py`): `submission` and `reference`, which
expose the exercise's functions and its adapters by name, and `draw`, seeded inputs.
A call on `submission` runs in the learner's sandboxed process when a notebook is graded, and
comes back as observations: `TensorValue` for tensors, plain values as they are, `OtherValue`
for anything else, dicts, lists and tuples of these. `reference` gives the same observations
from the course's solution, run in float64, or, for an adapter given an `@oracle`, from the
oracle: the definition the solution computes by other means, where the solution's own way would
cost the grader more than the learner's code does (a kernel in Triton's interpreter).
`assert_same` holds one against the other.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch

from autograde.cases import TOLERANCE, Draw, Inputs
from autograde.compare import compare_floats, compare_tensor, describe
from autograde.observe import ContractError, OtherValue, TensorValue, kind_of, observe, pair, raised

__all__ = ["oracle", "oracle_of", "assert_rule", "assert_same", "returned_pair", "Draw", "Inputs", "ContractError",
           "TensorValue", "OtherValue", "kind_of", "pair", "raised", "compare_floats", "TOLERANCE", "observed",
           "observed_rows"]


def oracle(of: Callable) -> Callable[[Callable], Callable]:
    """Mark `function(inputs)` as what `reference` returns for the adapter `of`, in place of the
    solution run through it: an independent computation of the same observations, in float64.
    It runs in the grading process on the course's own inputs, never on learner code."""
    def mark(function: Callable) -> Callable:
        of.__autograde_oracle__ = function
        return function
    return mark


def oracle_of(adapter_function: Callable) -> Callable | None:
    return getattr(adapter_function, "__autograde_oracle__", None)


def returned_pair(result: Any, call: str, names: str = "(out, weights)") -> tuple:
    """An observed result that must be a pair: the pair, or an AssertionError naming the call."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = describe(result) if isinstance(result, (TensorValue, OtherValue)) else kind_of(result)
        raise AssertionError(f"{call} must return a pair {names}; it returned {got}")
    return tuple(result)


def _problems(key: str, got: Any, want: Any, dtype: str, device: str) -> list[str]:
    if isinstance(want, TensorValue):
        return compare_tensor(key, want, got, dtype, device)
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"`{key}`: expected a dict, got {describe(got)}"]
        problems = []
        for name, item in want.items():
            label = name if key == "" else f"{key}[{name!r}]"
            problems += ([f"`{label}`: missing from the result"] if name not in got
                         else _problems(label, got[name], item, dtype, device))
        return problems
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"`{key}`: expected {len(want)} values, got {describe(got)}"]
        return [p for index, (g, w) in enumerate(zip(got, want))
                for p in _problems(f"{key}[{index}]", g, w, dtype, device)]
    if isinstance(want, float) and type(got) is float and np.isclose(got, want, rtol=1e-9, atol=0):
        return []
    if type(got) is not type(want) or got != want:
        if isinstance(want, int) and isinstance(got, float) and got == want:
            return [f"`{key}`: expected an int, {want!r}; got the float {got!r}"]
        return [f"`{key}`: expected {describe(want)}, got {describe(got)}"]
    return []


def observed_rows(got: Any, shapes: Mapping[str, tuple[int, ...]], rows: torch.Tensor, axis: int) -> Any:
    """The `rows` (indices along `axis`) of each tensor `shapes` names in `got`, a dict of observations,
    for a check of part of a result too large for the grader to compute whole; a tensor whose shape is
    not the one `shapes` gives fails here, and anything else is left for `assert_same` to describe."""
    if not isinstance(got, dict):
        return got
    problems, picked = [], dict(got)
    for key, shape in shapes.items():
        value = got.get(key)
        if not isinstance(value, TensorValue) or value.array is None:
            continue
        if value.shape != tuple(shape):
            problems.append(f"`{key}`: expected shape {tuple(shape)}, got {value.shape}")
            continue
        array = np.take(value.array, rows.numpy(), axis=axis)
        picked[key] = TensorValue(array.shape, value.dtype, value.device, array)
    if problems:
        raise AssertionError("\n".join(problems))
    return picked


def observed(values: Mapping[str, torch.Tensor]) -> dict:
    """The observations of tensors computed in the grading process, as `assert_same` takes them."""
    return {key: observe(value) for key, value in values.items()}


def assert_rule(got: dict, expected: dict, rule, inputs: Inputs | None = None) -> None:
    """The learner's measurements in `got` keep `rule` (an `autograde.rules.judge.Rule`), whatever the values."""
    if not isinstance(got, dict):
        raise AssertionError(f"{rule.name} rule: expected measurements, got {describe(got)}")
    missing = [key for key in rule.keys if key not in got]
    problems = [f"`{key}`: missing from the result" for key in missing] or rule.judge(expected, got)
    if problems:
        lines = [f"inputs: {inputs.describe()}"] if inputs is not None else []
        raise AssertionError("\n".join(lines + problems))


def assert_same(got: Any, expected: Any, inputs: Inputs | None = None, like: Any = None,
                ignore: tuple[str, ...] = ()) -> None:
    """`got` (the learner's observations) agrees with `expected` (the reference's), else an
    AssertionError listing each difference: shapes, dtypes, NaNs and where, the largest error,
    its index and the tolerance. Floating-point results must have the dtype and device of
    `like`, by default the first tensor of `inputs` (the call's first tensor argument); the
    tolerance is that dtype's, relative to max(1, largest expected magnitude)."""
    first = like if like is not None else (inputs.first_tensor() if inputs is not None else None)
    dtype = str(first.dtype) if first is not None else "torch.float32"
    device = first.device.type if first is not None else "cpu"

    def differences(got: Any, expected: Any) -> list[str]:
        return _problems("", got, expected, dtype, device) if not isinstance(expected, dict) else [
            p for name, want in expected.items() if name not in ignore
            for p in ([f"`{name}`: missing from the result"] if not isinstance(got, dict) or name not in got
                      else _problems(name, got[name], want, dtype, device))]

    problems = differences(got, expected)
    if problems:
        from autograde import misconceptions  # imported late: it reaches the solutions and the sandbox's calls

        lines = [f"inputs: {inputs.describe()}"] if inputs is not None else []
        cause = misconceptions.diagnose(got, expected, differences)
        raise AssertionError("\n".join(lines + problems + ([f"likely cause: {cause}"] if cause else [])))
