"""The tripwire: a not-allowed function stopped and recorded while the submission runs.

It catches what the source hides from the scan (`autograde.submission.forbidden`), at two levels.
A not-allowed function written in Python (`F.multi_head_attention_forward`,
`nn.MultiheadAttention.forward`, flex_attention, `F.softmax`) has its code replaced by a stopper,
so the function object stops under any name it is reached by: an alias, `getattr`, a module
calling it for you. The functions written in C (`F.scaled_dot_product_attention`, `torch.softmax`,
`Tensor.logsumexp`...) stop at the operators underneath: their kernels (`aten._softmax`, PyTorch's
attention kernels) are replaced in the dispatcher, those operators however they were reached,
`torch.ops.aten` or `DisableTorchFunction` included. Both levels hold for every thread of the
process, and neither costs the calls that are allowed anything (a torch function mode, which saw
every torch call in Python, made the flash exercises' block loops 1.25 to 1.5 times slower).
It runs in the learner's process, which can switch it off: it is advisory, and the scan and the
rules' tests are what count. In the sandbox its findings leave the process as they happen
(`report`), and after each call the worker says whether it still stands (`intact`).
"""

from __future__ import annotations

import importlib
import traceback
import types
import warnings
from typing import Iterable

import torch

from autograde.observe import learner_line
from autograde.rules.measure import kernels_of
from autograde.submission.forbidden import Violation


class ForbiddenCall(RuntimeError):
    pass


def resolve(name: str):
    """The object a qualified name refers to, e.g. `torch.Tensor.softmax`."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(name)


# The operators underneath the not-allowed functions written in C, by the name a call that reaches
# them is reported under: what reaches them is that function, under whatever name (PyTorch's
# attention kernels, and `_safe_softmax`, the softmax of its unfused attention; the softmax
# family's operators). Each name is one of the exercises' not-allowed names.
_OPERATORS = {
    "torch.nn.functional.scaled_dot_product_attention": (
        "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
        "_safe_softmax"),
    "torch._native_multi_head_attention": ("_native_multi_head_attention",),
    "torch.softmax": ("softmax", "_softmax", "_safe_softmax"),
    "torch.log_softmax": ("log_softmax", "_log_softmax"),
    "torch.logsumexp": ("logsumexp",),
}


def operators(not_allowed: Iterable[str]) -> dict:
    """The aten operators that `not_allowed` rules out, each with the name it is reported under."""
    found = {}
    for name in not_allowed:
        for operator in _OPERATORS.get(name, ()):
            packet = getattr(torch.ops.aten, operator, None)  # absent from some builds
            if packet is not None:
                found.setdefault(packet, name)
    return found


# A call of one operator of each kind the tripwire replaces, to see that it still stops them.
_PROBES = {
    "torch.nn.functional.scaled_dot_product_attention":
        lambda: torch.ops.aten._scaled_dot_product_attention_math(*[torch.zeros(1, 1, 1)] * 3),
    "torch.softmax": lambda: torch.ops.aten._softmax(torch.zeros(1), 0, False),
}


class Tripwire:
    """While entered, a call of a not-allowed torch function, or of an operator underneath one, is
    recorded, handed to `report` at once (in the worker: sent to the grading process, so that
    what learner code does afterwards cannot take it back) and raises ForbiddenCall."""

    def __init__(self, not_allowed: Iterable[str], report=None):
        not_allowed = tuple(not_allowed)
        self.violations: list[Violation] = []
        self.report = report
        self._probes = [probe for name, probe in _PROBES.items() if name in not_allowed]
        self._probing = False
        # Every name must resolve; those written in C stop at their operators (`_OperatorTripwire`).
        resolved = {resolve(name): name for name in not_allowed}
        self._functions = _FunctionTripwire(self, {function: name for function, name in resolved.items()
                                                   if isinstance(function, types.FunctionType)})
        self._operators = _OperatorTripwire(self, operators(not_allowed))

    def intact(self) -> bool:
        """Whether, while entered, it still stands as it was installed: each Python function's code
        still the stopper, and the operators' kernels still replaced (a call of each kind stops)."""
        if not self._functions.standing():
            return False
        self._probing = True
        try:
            with torch._C.DisableTorchFunction():  # a function mode of the learner's cannot answer for it
                for probe in self._probes:
                    try:
                        probe()
                    except ForbiddenCall:
                        continue
                    except Exception:
                        return False
                    return False
        finally:
            self._probing = False
        return True

    def __enter__(self):
        self._operators.__enter__()
        try:
            self._functions.__enter__()
        except BaseException:
            self._operators.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        try:
            self._functions.__exit__(*exc_info)
        finally:
            self._operators.__exit__(*exc_info)

    def stop(self, name: str):
        if not self._probing:
            violation = Violation(name, learner_line(traceback.extract_stack()))
            if violation not in self.violations:
                self.violations.append(violation)
                if self.report is not None:
                    self.report(violation)
        raise ForbiddenCall(f"{name} is not allowed in this exercise")


# The stopper's code: a call of the tripwire's `stop` with the function's name, both placed among
# the code's constants (`_FunctionTripwire`), as the function's own globals are its module's. Its
# file is this one, which tracebacks and `learner_line` know as the grader's.
_STOP, _NAME = "tripwire: stop", "tripwire: name"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "'str' object is not callable": the constants are replaced
    _STOPPER = next(constant for constant in compile(
        f"def stopper(*args, **kwargs):\n    return {_STOP!r}({_NAME!r})\n", __file__, "exec").co_consts
        if isinstance(constant, types.CodeType))


class _FunctionTripwire:
    """The Python half of a `Tripwire`: while entered, each not-allowed function written in Python
    runs a stopper instead of its own code. The function object itself changes, so every name that
    refers to it stops, in every thread, and no other call pays anything."""

    def __init__(self, owner: Tripwire, targets: dict):
        self._stoppers = {function: _STOPPER.replace(
            co_consts=tuple(owner.stop if c == _STOP else name if c == _NAME else c for c in _STOPPER.co_consts),
            co_name=function.__code__.co_name) for function, name in targets.items()}
        self._own: list[dict] = []  # for each entry, the functions' own code, to put back at its exit

    def __enter__(self):
        own = {}
        self._own.append(own)
        for function, stopper in self._stoppers.items():
            own[function] = function.__code__
            function.__code__ = stopper
        return self

    def __exit__(self, *exc_info):
        for function, code in self._own.pop().items():
            function.__code__ = code

    def standing(self) -> bool:
        return all(function.__code__ is stopper for function, stopper in self._stoppers.items())


# The dispatch keys an operator's kernels are registered under: each device's, and the composite
# ones that serve every device. Replacing every kernel an operator has stops it on any device,
# with or without autograd, under `no_grad` and `inference_mode`.
_KERNEL_KEYS = ("CPU", "CUDA", "MPS", "XPU", "NestedTensorCPU", "NestedTensorCUDA", "SparseCPU", "SparseCUDA",
                "CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


class _OperatorTripwire:
    """The dispatcher's half of a `Tripwire`: while entered, every kernel of the not-allowed
    operators is replaced by one that stops the call, so no alias and no way of calling goes
    around it. Only those operators change; every other one runs at full speed, which a
    dispatch mode seeing every operator in Python would not allow."""

    def __init__(self, owner: Tripwire, targets: dict):
        self.owner = owner
        # (overload, dispatch key, name reported)
        self._kernels = [(overload, key, name) for packet, name in targets.items()
                         for overload, key in kernels_of(packet, _KERNEL_KEYS)]
        self._library = None

    def __enter__(self):
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": as meant
            for overload, key, name in self._kernels:
                library.impl(overload, self._stopper(name), key)
        self._library = library
        return self

    def __exit__(self, *exc_info):
        library, self._library = self._library, None
        if library is not None:
            library._destroy()  # the operators' own kernels are back

    def _stopper(self, name: str):
        def stop(*args, **kwargs):
            self.owner.stop(name)
        return stop
