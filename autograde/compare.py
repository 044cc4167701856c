"""Hold a submission's observations against the reference's and say precisely what differs;
`CaseResult`, what one test found."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autograde.cases import TOLERANCE
from autograde.observe import OtherValue, TensorValue

NOT_RUN = "not run: "
FLOAT32_HINT = "computed in float32? the contract asks float64 for float64 inputs"


def total(points) -> float:
    """A sum of points: exact where the points add up to a round number (a parametrised test's
    share, 10/3, three times, is 10, not 10.000000000000002)."""
    return round(math.fsum(points), 9)


@dataclass(frozen=True)
class CaseResult:
    name: str
    points: float
    visible: bool
    about: str
    inputs: str
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def test(self) -> str:
        """The test's name without a parametrised case's id: `forward-random` of `forward-random[L < S, ...]`."""
        return self.name.split("[", 1)[0]

    @property
    def case(self) -> str:
        """A parametrised case's id (`L < S, ...`), else ""."""
        return self.name[len(self.test) + 1:-1] if "[" in self.name else ""

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def earned(self) -> float:
        return self.points if self.passed else 0.0

    @property
    def ran(self) -> bool:
        """False when the test never ran: no notebook, an invalid one, or the worker gone before it."""
        return not (self.problems and self.problems[0].startswith(NOT_RUN))


def describe(value) -> str:
    if isinstance(value, TensorValue):
        return f"a tensor of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, OtherValue):
        return f"a {value.type_name}"
    return repr(value)


def index_text(flat_index: int, shape: tuple[int, ...]) -> str:
    return str(tuple(int(i) for i in np.unravel_index(flat_index, shape))) if shape else "()"


def compare_exact(key: str, expected: np.ndarray, got: np.ndarray) -> list[str]:
    wrong = np.flatnonzero(expected.ravel() != got.ravel())
    if not wrong.size:
        return []
    first = wrong[0]
    return [f"`{key}`: {wrong.size} of {expected.size} entries differ, first at index "
            f"{index_text(first, expected.shape)}: expected {expected.ravel()[first]}, got {got.ravel()[first]}"]


def compare_floats(key: str, expected: np.ndarray, got: np.ndarray, tolerance: float) -> list[str]:
    problems = []
    # A signalling NaN (memory left uninitialised) raises "invalid", reported below; a difference may overflow.
    with np.errstate(invalid="ignore", over="ignore"):
        got = got.astype(np.float64)
        # Most results pass: every error within the tolerance (the scale is at least 1) in one pass. A NaN
        # or an infinite error compares false here and takes the path below, which says what it is.
        if not got.size or float(np.max(np.abs(got - expected))) <= tolerance:
            return problems
    nans = np.flatnonzero(np.isnan(got.ravel()) & ~np.isnan(expected.ravel()))
    if nans.size:
        problems.append(f"`{key}`: {nans.size} NaN{'s' if nans.size > 1 else ''} where the expected values are "
                        f"not NaN, first at index {index_text(nans[0], expected.shape)}")
    # Equal values (infinities included) and the NaNs just reported count as no error here.
    same = (got == expected) | np.isnan(got)
    with np.errstate(invalid="ignore"):
        error = np.where(same, 0.0, np.abs(got - expected))
    error = np.nan_to_num(error, nan=np.inf, posinf=np.inf)  # an infinite error is `inf`, not 1.8e+308
    finite = np.abs(expected[np.isfinite(expected)])
    scale = max(1.0, float(finite.max()) if finite.size else 1.0)
    allowed = tolerance * scale
    if error.size and error.max() > allowed:
        worst = int(np.argmax(error))
        # Within float32's tolerance but not float64's: the values agree to the digits float32
        # holds, so they are printed with more, and the likely cause is named.
        single = tolerance < TOLERANCE["torch.float32"] and error.max() <= TOLERANCE["torch.float32"] * scale
        digits = ".12g" if single else ".6g"
        problems.append(
            f"`{key}`: max abs error {error.ravel()[worst]:.3g} at index {index_text(worst, expected.shape)} "
            f"(expected {expected.ravel()[worst]:{digits}}, got {got.ravel()[worst]:{digits}}); "
            f"tolerance {allowed:.3g}" + (f"; {FLOAT32_HINT}" if single else ""))
    return problems


def compare_tensor(key: str, expected: TensorValue, got, dtype: str, device: str) -> list[str]:
    """`dtype` and `device`: what a float output should have (those of the first tensor argument)."""
    if not isinstance(got, TensorValue):
        return [f"`{key}`: expected a tensor of shape {expected.shape}, got {describe(got)}"]
    if got.shape != expected.shape:
        return [f"`{key}`: expected shape {expected.shape}, got {got.shape}"]
    floating = np.issubdtype(expected.array.dtype, np.floating)
    want = dtype if floating else expected.dtype
    problems = []
    if got.dtype != want:
        because = " (the dtype of the first tensor argument)" if floating else ""
        problems.append(f"`{key}`: expected dtype {want}{because}, got {got.dtype}")
    if got.device != device:
        problems.append(f"`{key}`: expected device {device} (that of the first tensor argument), got {got.device}")
    if floating:
        problems += compare_floats(key, expected.array, got.array, TOLERANCE.get(want, TOLERANCE["torch.float32"]))
    else:
        problems += compare_exact(key, expected.array, got.array)
    return problems
