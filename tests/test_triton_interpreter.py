"""Triton's interpreter with each language module patched once per launch
(`autograde.triton_interpreter`): the same values as Triton's own code, and the kernel's language
restored after a launch; its overflow check, whose assertion it skips, not computed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

tl = pytest.importorskip("triton.language")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from autograde import triton_interpreter  # noqa: E402

ROWS, COLUMNS = 8, 16


def row_max(x):  # a device function: a call inside the kernel, with tl.max, itself one, inside it
    return tl.max(x, axis=1)


def rows_kernel(x_ptr, max_ptr, sum_ptr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    rows, columns = tl.arange(0, ROWS), tl.arange(0, COLUMNS)
    x = tl.load(x_ptr + rows[:, None] * COLUMNS + columns[None, :])
    tl.store(max_ptr + rows, row_max_interpreted(x))
    tl.store(sum_ptr + rows, tl.sum(x - row_max_interpreted(x)[:, None], axis=1))


def offsets_kernel(out_ptr, COLUMNS: tl.constexpr):  # 32-bit integer arithmetic, which Triton checks for overflow
    columns = tl.arange(0, COLUMNS)
    tl.store(out_ptr + columns, columns * 3 + 7 - columns)


# Built directly, so that the interpreter runs them whatever TRITON_INTERPRET said when Triton was imported.
row_max_interpreted = interpreter.InterpretedFunction(row_max)
rows_kernel_interpreted = interpreter.InterpretedFunction(rows_kernel)
offsets_kernel_interpreted = interpreter.InterpretedFunction(offsets_kernel)


def kernel_language() -> dict:
    """What the kernel's launch patches and restores: `triton.language`, its tensor class and `math`
    (where the calls inside the kernel leave, as in Triton, `tensor.__repr__` and the like)."""
    return {(module.__name__, name): value for module in (tl, tl.tensor, tl.math)
            for name, value in vars(module).items() if not name.startswith("__")}


def launch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS).flip(1) % 7
    maxima, sums = torch.empty(ROWS), torch.empty(ROWS)
    rows_kernel_interpreted[(1,)](x, maxima, sums, ROWS=ROWS, COLUMNS=COLUMNS)
    return x, maxima, sums


@pytest.fixture
def patchings(monkeypatch) -> list:
    """The function behind each `_patch_lang` call of the interpreter, recorded."""
    triton_interpreter.install()
    triton_interpreter.install()  # once per process, however often it is asked
    calls, patch_lang = [], interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn.__name__) or patch_lang(fn))
    return calls


def test_each_language_module_is_patched_once_per_launch_with_the_same_values(patchings, monkeypatch):
    before = kernel_language()
    x, maxima, sums = launch()
    # The launch patches `tl`; the first tl.max patches `tl.core`, which it sees; every other call patches nothing.
    assert patchings == ["rows_kernel", "max"]
    assert torch.equal(maxima, x.max(dim=1).values)
    assert torch.equal(sums, (x - x.max(dim=1, keepdim=True).values).sum(dim=1))
    assert kernel_language() == before, "the kernel's language was not restored after the launch"

    patchings.clear()
    for cls in (interpreter.GridExecutor, interpreter.InterpretedFunction):  # Triton's own code
        monkeypatch.setattr(cls, "__call__", cls.__call__.__wrapped__)
    _, triton_maxima, triton_sums = launch()
    assert len(patchings) == 6, patchings  # the launch, and each of the five calls inside it
    assert torch.equal(triton_maxima, maxima) and torch.equal(triton_sums, sums)
    assert kernel_language() == before


def test_a_device_function_called_outside_a_launch_runs_as_in_triton(patchings):
    with pytest.raises(interpreter.InterpreterError):  # outside a kernel there is no grid to run in
        row_max_interpreted(torch.zeros(2, 2))
    assert patchings == ["row_max", "max"]  # every call patches, as Triton does


def test_the_overflow_check_whose_assertion_the_interpreter_skips_is_not_computed(monkeypatch):
    triton_interpreter.install()
    builder = interpreter.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow
    unchecked = torch.empty(COLUMNS, dtype=torch.int32)
    offsets_kernel_interpreted[(1,)](unchecked, COLUMNS=COLUMNS)
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True))
    checked = torch.empty_like(unchecked)
    offsets_kernel_interpreted[(1,)](checked, COLUMNS=COLUMNS)
    assert torch.equal(unchecked, checked) and torch.equal(checked, torch.arange(COLUMNS, dtype=torch.int32) * 2 + 7)
