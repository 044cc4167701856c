"""What a call produced, as plain data: tensors become numpy arrays, exceptions a short account.

The probes of the exercise definitions reach the learner's functions through `Submission`,
and check the shape of what comes back with `pair` and `raised`. Their results become
observations (`observe`): `TensorValue`, `OtherValue` or a plain JSON value; a probe that
raised becomes a `Failure` that names the learner's line.
"""

from __future__ import annotations

import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

MESSAGE_CHARS = 400
# Tensors whose dtype numpy lacks travel as float32; their own dtype is kept in `dtype`.
WIDENED = {torch.bfloat16: torch.float32}
_TRUSTED_DIRS = tuple(
    str(Path(p).resolve())
    for p in {Path(__file__).parent, *(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))}
)


class ContractError(Exception):
    """What the learner's function returned (or lacks) does not fit the exercise contract."""


class MissingDefinition(ContractError):
    def __init__(self, name: str):
        super().__init__(f"the notebook defines no `{name}` (did the cell that defines it run?)")


class Submission:
    """The learner's names, read from a namespace (the notebook's globals)."""

    def __init__(self, namespace: dict):
        self._namespace = namespace

    def __getattr__(self, name: str) -> Any:
        try:
            return self._namespace[name]
        except KeyError:
            raise MissingDefinition(name) from None


def kind_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def pair(result: Any, call: str, names: str = "(out, weights)") -> tuple:
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ContractError(f"{call} must return a pair {names}; it returned {kind_of(result)}")
    return tuple(result)


def raised(expected: type[BaseException], function: Callable, *args, **kwargs) -> str:
    """The name of what calling `function` raised: `expected.__name__`, another, or 'no exception'."""
    try:
        function(*args, **kwargs)
    except expected:
        return expected.__name__
    except Exception as exc:
        return type(exc).__name__
    return "no exception"


@dataclass(frozen=True)
class TensorValue:
    """A tensor's values, dtype and device; `array` is None when a wrong shape kept it unread."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    array: np.ndarray | None


@dataclass(frozen=True)
class OtherValue:
    """Something that is neither a tensor nor a plain value, known by its type only."""

    type_name: str


@dataclass(frozen=True)
class Failure:
    """A probe that produced nothing: it raised, ran out of time, or never ran."""

    kind: str  # "exception", "timeout" or "not run"
    type_name: str
    message: str
    where: str = ""

    def describe(self) -> str:
        if self.kind != "exception":
            return self.message
        if self.type_name == "NotImplementedError":
            text = "not implemented yet (it raises NotImplementedError)"
        elif self.type_name in ("ContractError", "MissingDefinition"):
            text = self.message
        else:
            text = f"{self.type_name}: {self.message}" if self.message else self.type_name
        return f"{text}, at {self.where}" if self.where else text


@dataclass
class CallCost:
    """What a call cost the learner's processes, measured `where`: how far it raised their memory
    (`growth_bytes`), how much of the writable memory they held it read or wrote
    (`referenced_bytes`), and the CPU time they spent (`cpu_seconds`); or why it could not be
    measured (`problem`)."""

    where: str
    growth_bytes: int | None = None
    referenced_bytes: int = 0
    cpu_seconds: float | None = None
    problem: str = ""


def observe_tensor(tensor: torch.Tensor) -> TensorValue | OtherValue:
    try:
        data = torch.Tensor.detach(tensor).cpu()
        dtype, device = data.dtype, torch.Tensor.detach(tensor).device.type
        array = data.to(WIDENED.get(dtype, dtype)).numpy()
    except TypeError:
        return OtherValue(f"Tensor of {tensor.dtype}")
    except Exception:  # not a tensor at all, whatever its __class__ says
        return OtherValue("object posing as a Tensor")
    if type(array) is not np.ndarray:
        return OtherValue("object posing as a Tensor")
    return TensorValue(tuple(array.shape), str(dtype), device, array)


def observe(value: Any, depth: int = 0) -> Any:
    """What a call returned as an observation (what `compare` reads and the worker sends):
    tensors as `TensorValue`, plain values as themselves, dicts, lists and tuples of these
    (a few levels deep), anything else as `OtherValue`."""
    if isinstance(value, torch.Tensor):
        return observe_tensor(value)
    if value is None or type(value) in (bool, int, float, str):
        return value
    if depth < 3 and type(value) in (tuple, list) and len(value) <= 64:
        return type(value)(observe(item, depth + 1) for item in value)
    if depth < 3 and type(value) is dict and len(value) <= 64 and all(type(key) is str for key in value):
        return {key: observe(item, depth + 1) for key, item in value.items()}
    return OtherValue(kind_of(value).removeprefix("a "))


def _cell_label(filename: str) -> str:
    """'cell 5' for the worker's cells, 'In [7]' for cells run in a Jupyter kernel."""
    if filename.startswith("<cell "):
        return filename.strip("<>")
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return f"In [{number}]" if number is not None else Path(filename).name


def learner_line(frames: traceback.StackSummary) -> str:
    """'cell 5, line 3: `code`' for the innermost frame in the learner's own code, else ''."""
    for frame in reversed(frames):
        filename = frame.filename
        if filename.startswith("<"):
            if not filename.startswith(("<cell ", "<ipython-input")):
                continue
        elif str(Path(filename).resolve()).startswith(_TRUSTED_DIRS):
            continue
        code = f": `{frame.line.strip()}`" if frame.line else ""
        return f"{_cell_label(filename)}, line {frame.lineno}{code}"
    return ""


def failure_from(exc: BaseException) -> Failure:
    message = str(exc)
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + " ..."
    return Failure("exception", type(exc).__name__, message, learner_line(traceback.extract_tb(exc.__traceback__)))
