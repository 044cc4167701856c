"""The measurements of the rules, made in the learner's process while an adapter calls its code.

- `Footprint`: the largest tensor created during a call (every tensor an operator returns,
  views included, by number of elements) and the elements every operation computes;
- `MatmulFlops`: the matmul FLOPs of a call, counted with the formulas of
  `torch.utils.flop_counter.FlopCounterMode`;
- `AutogradRecorded`: the tensors autograd saved for a backward during a call;
- `saved_for_backward`: what an autograd Function's forward kept for its backward;
- `TritonLaunches`: how many Triton kernels a call launched, compiled or interpreted, and the
  values they left in the tensors they were given;
- `Reductions`: the most values that one reduction (a max, a sum, a matrix product, ...)
  combined into one result during a call.

The learner's code could switch them off: they are advisory (`rules.judge` holds their numbers
against the limits; two rules are also measured from outside the process).
"""


from __future__ import annotations

import math
import sys
import warnings
from typing import Iterator

import torch
from torch.utils import _python_dispatch, _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autograde import triton_interpreter
from autograde.observe import ContractError

# The matrix products of FlopCounterMode's table; its attention and convolution entries have no place here.
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class _Measuring(TorchDispatchMode):
    """A mode that measures, wrapped for torch.compile only where torch.compile has been loaded.

    torch wraps the handler of every dispatch mode so that torch.compile does not trace into it, and
    the wrapper imports torch._dynamo at the mode's first use: a second of CPU time in each grading
    process and each fork server, which never compile. The handler is wrapped as usual wherever
    torch._dynamo is loaded when this module is (a learner's kernel that compiled something before
    its first `check()`, say). Unwrapped, code compiled with torch.compile inside a measured call
    still runs under the mode, and is measured as the same code run eagerly is."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return "torch._dynamo" in sys.modules


class Footprint(_Measuring):
    """While active: the largest tensor any operator returns, and the elements of all but views."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.produced = 0  # elements computed: of every tensor returned but views, however the work is split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in _returned_tensors(out):
            self.largest = max(self.largest, value.numel())
            if not func.is_view:
                self.produced += value.numel()
        return out


class MatmulFlops:
    """While active: the matmul FLOPs spent, in every thread, as `FlopCounterMode` counts them (its
    formulas, 2 m n k per product, for each overload of its matrix products).

    Each device kernel of those operators is replaced by one that calls it and counts
    (`torch.library.get_kernel`, torch 2.9 and later), so every other operator runs at full speed:
    a dispatch mode sees each of the thousands of small operations of a tiled loop in Python, about
    20 µs each. In the dispatcher, the count also takes in products made in another thread, which a
    mode, one thread's, does not see. Before torch 2.9, a dispatch mode counts them, in this thread."""

    def __enter__(self) -> "MatmulFlops":
        # Imported here, not with this module: it imports Triton, which must not be imported
        # before the grading process has chosen whether to interpret kernels (see flash_triton).
        from torch.utils.flop_counter import flop_registry

        self.matmul_flops = 0
        formulas = {packet: _on_shapes(flop_registry[packet]) for packet in _MATMULS}
        if not hasattr(torch.library, "get_kernel"):
            self._counter = _MatmulCountingMode(self, formulas)
            self._counter.__enter__()
            return self
        self._counter = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": as meant
            for packet, formula in formulas.items():
                for name, key in kernels_of(packet, _DEVICE_KEYS):
                    kernel = torch.library.get_kernel(f"aten::{name}", key)
                    self._counter.impl(name, self._counting(kernel, formula), key, with_keyset=True)
        return self

    def _counting(self, kernel, formula):
        def counted(keyset, *args, **kwargs):
            out = kernel.call_boxed(keyset, *args, **kwargs)
            self.matmul_flops += formula(*args, **kwargs, out_val=out)
            return out
        return counted

    def __exit__(self, *exc) -> None:
        if isinstance(self._counter, torch.library.Library):
            self._counter._destroy()  # the operators' own kernels are back
        else:
            self._counter.__exit__(*exc)


class _MatmulCountingMode(_Measuring):
    """`MatmulFlops` before torch 2.9, which cannot call a kernel it replaces: every operator seen."""

    def __init__(self, owner: MatmulFlops, formulas: dict):
        super().__init__()
        self.owner, self.formulas = owner, formulas

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None:
            self.owner.matmul_flops += formula(*args, **kwargs, out_val=out)
        return out


_DEVICE_KEYS = ("CPU", "CUDA", "MPS", "XPU")


def kernels_of(packet, keys: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """(overload, dispatch key) of each kernel registered for an aten operator under one of `keys`,
    e.g. ("_softmax.out", "CPU"): what a `torch.library.Library("aten", "IMPL")` may replace."""
    for overload in packet.overloads():
        name = packet.__name__ if overload == "default" else f"{packet.__name__}.{overload}"
        for key in keys:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
                yield name, key


# A tiled loop makes thousands of small operations in a call, so the handlers here avoid torch's
# pytrees (about a fifth of a call's CPU time under a dispatch mode seeing every operator).

def _on_shapes(formula):
    """A formula of `flop_registry`, called on the shapes of the operator's tensors. The registry
    wraps each formula to map every argument through a pytree; where it keeps the formula itself
    (`__wrapped__`), that is called on the shapes directly."""
    raw = getattr(formula, "__wrapped__", None)
    if raw is None:
        return formula

    def counted(*args, out_val, **kwargs):
        return raw(*(value.shape if isinstance(value, torch.Tensor) else value for value in args), **kwargs,
                   out_shape=out_val.shape)
    return counted


def _returned_tensors(out) -> list[torch.Tensor]:
    """The tensors an operator returned: one, a flat tuple or list of them (a split), or else the
    tensors of whatever structure it is."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(value, torch.Tensor) for value in out):
        return list(out)
    return [value for value in _pytree.tree_leaves(out) if isinstance(value, torch.Tensor)]


class AutogradRecorded:
    """While active: how many tensors autograd saved for a backward, that is, whether code recorded
    a graph to differentiate (`torch.autograd.graph.saved_tensors_hooks`, in this thread)."""

    def __enter__(self) -> "AutogradRecorded":
        self.saved = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved += 1
        return tensor

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_for_backward(output: torch.Tensor, known: dict[str, torch.Tensor]) -> str:
    """What the autograd Function that produced `output` keeps for its backward, in words.

    Each tensor given to `ctx.save_for_backward` or stored as an attribute of `ctx` (once if
    both) is named after the tensor of `known` that it equals (as many elements, values within 1e-4,
    since a name may come from another computation than the learner's), or else described by
    its shape. The names come in the order of `known`, then the others.
    """
    node = output.grad_fn
    if node is None:
        raise ContractError("the output has no grad_fn: was it computed by your autograd Function?")
    kept = list(node.saved_tensors)
    for value in vars(node).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        kept += [v for v in values if isinstance(v, torch.Tensor)]
    # A tensor both saved and stored on `ctx` occupies its memory once.
    distinct = {(t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()): t for t in kept}
    named, others = [], []
    for tensor in distinct.values():
        name = next((name for name, value in known.items() if _same(tensor, value)), None)
        if name is None:
            others.append(f"a tensor of shape {tuple(tensor.shape)}")
        else:
            named.append(name)
    order = list(known)
    return ", ".join(sorted(named, key=order.index) + others) or "nothing"


def _same(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    if tensor.numel() != value.numel():
        return False
    tensor, value = tensor.detach().cpu().double().reshape(value.shape), value.detach().cpu().double()
    return torch.allclose(tensor, value, rtol=1e-4, atol=1e-4)


class TritonLaunches:
    """While active, `count` is the number of Triton kernel launches (`kernel[grid](...)`) that
    ran to the end, and `written` the values each of them left in the tensors it was given.

    Compiled kernels (`JITFunction`) and those of the interpreter (`InterpretedFunction`,
    TRITON_INTERPRET=1) both launch through their `run` method, which is wrapped here. A launch
    runs outside any dispatch mode (`Reductions`, say): what it computes is the kernel's work.
    """

    def __enter__(self) -> "TritonLaunches":
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:
            raise ContractError("Triton is not installed: `pip install triton`") from None
        triton_interpreter.install()
        self.count = 0
        self.written: list[torch.Tensor] = []
        self._originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
        for cls, original in self._originals.items():
            cls.run = self._counting(original)
        return self

    def _counting(self, original):
        def run(kernel, *args, **kwargs):
            if kwargs.get("warmup"):
                return original(kernel, *args, **kwargs)
            with _python_dispatch._disable_current_modes():
                launched = original(kernel, *args, **kwargs)
                # Counted once it has run: a launch that raises (and is caught) computed nothing.
                self.count += 1
                self.written += [a.detach().clone() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            return launched
        return run

    def __exit__(self, *exc) -> None:
        for cls, original in self._originals.items():
            cls.run = original

    def wrote(self, result: torch.Tensor) -> bool:
        """Whether `result` holds values a launch left in one tensor it was given: all of them or a
        part, in any layout or order. Real kernels store into a buffer rounded up to a block multiple,
        or run on inputs padded to block multiples, and the wrapper returns views, slices or copies
        of part of what they stored (FlashAttention's own kernel returns `lse[:, :, :L]` of a buffer
        of 128-row blocks); what the result holds must still be values the kernel stored."""
        values = _bits(result)
        return any(tensor.numel() >= result.numel() and _holds(_bits(tensor.to(result.dtype)), values)
                   for tensor in self.written)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The values of `tensor`, sorted, as integers that are equal exactly where the values are: the bits
    of floats, with -0.0 read as 0.0 and every NaN as one NaN."""
    values = tensor.detach().flatten().cpu()
    if not values.is_floating_point():
        return values.to(torch.int64).sort().values
    values = torch.where(values == 0, torch.zeros_like(values), values)
    values = torch.where(values.isnan(), torch.full_like(values, math.nan), values)
    integers = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    return values.contiguous().view(integers).sort().values


def _holds(stored: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether the multiset of `part` is within that of `stored` (both from `_bits`)."""
    if not part.numel():
        return True
    kept, kept_counts = torch.unique_consecutive(stored, return_counts=True)
    wanted, wanted_counts = torch.unique_consecutive(part, return_counts=True)
    where = torch.searchsorted(kept, wanted).clamp(max=kept.numel() - 1)
    return bool(kept.numel() and (kept[where] == wanted).all() and (kept_counts[where] >= wanted_counts).all())


# Reductions along a `dim` argument that the `reduction` tag of the operator table does not mark:
# softmaxes, scans and selections, each of which can stand in for a max or a sum.
_ALONG_DIM = {torch.ops.aten._softmax, torch.ops.aten._log_softmax, torch.ops.aten._safe_softmax,
              torch.ops.aten.cumsum, torch.ops.aten.cumprod, torch.ops.aten.logcumsumexp, torch.ops.aten.cummax,
              torch.ops.aten.cummin, torch.ops.aten.sort, torch.ops.aten.topk, torch.ops.aten.kthvalue,
              torch.ops.aten.median, torch.ops.aten.nanmedian, torch.ops.aten.mode}
# Matrix products sum over their inner dimension: `x @ ones` is a sum too.
_PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
             torch.ops.aten.mv, torch.ops.aten.addmv, torch.ops.aten.dot, torch.ops.aten.vdot}


class Reductions(_Measuring):
    """While active: `widest`, the most values any one reduction combined into one result, and
    `widest_call`, that operator and the shape it reduced.

    A reduction is an operator tagged `reduction` (max, amax, sum, mean, logsumexp, norm, ...),
    a softmax, scan or selection along a dimension, or a matrix product (which sums over its
    inner dimension). Only floating-point inputs count: `mask.any()` combines no scores.
    """

    def __init__(self):
        super().__init__()
        self.widest = 0
        self.widest_call = "no reduction"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        width = self._width(func, args, kwargs)
        if width > self.widest:
            shape = tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else ()
            self.widest, self.widest_call = width, f"{func.overloadpacket.__name__} of a tensor of shape {shape}"
        return out

    @staticmethod
    def _width(func, args, kwargs) -> int:
        packet = func.overloadpacket
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or not tensors[0].is_floating_point():
            return 0
        if packet in _PRODUCTS:
            # The inner dimension: the last of the left operand (mm, bmm, mv, dot) or of the one
            # after the added term (addmm, baddbmm, addmv).
            left = tensors[1] if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm, torch.ops.aten.addmv) \
                else tensors[0]
            return left.shape[-1] if left.dim() else 1
        if packet not in _ALONG_DIM and torch.Tag.reduction not in func.tags:
            return 0
        shape = tensors[0].shape
        schema = func._schema.arguments
        bound = {a.name: a.default_value for a in schema if a.has_default_value()}
        bound.update({**dict(zip((a.name for a in schema), args)), **kwargs})
        dims = bound.get("dim")
        if dims is None or dims == []:  # no dim: every element
            return math.prod(shape)
        dims = [dims] if isinstance(dims, int) else list(dims)
        return math.prod(shape[d] for d in dims) if shape else 1


# The names an adapter reports its measurements under; `rules.judge` reads them by the same names.

def memory_keys(function: str) -> tuple[str, str]:
    """`(largest, limit)`: the largest tensor `function` created (`Footprint`), and what the memory rule allows."""
    return (f"largest tensor created by {function} (elements)",
            "max(q.numel(), k.numel(), v.numel(), B*H*block_q*block_k)")


def work_keys() -> tuple[str, str, str]:
    """`(causal, full, allowed)`: the matmul FLOPs with and without the causal mask, and the largest ratio allowed."""
    return "matmul FLOPs with causal=True", "matmul FLOPs with causal=False", "largest ratio allowed"


def saved_key(function: str) -> str:
    """What `function`'s forward saved for its backward (`saved_for_backward`)."""
    return f"tensors {function}'s forward saves for backward"


def by_hand_key(function: str) -> str:
    """The tensors autograd saved for a backward while `function` ran (`AutogradRecorded`)."""
    return f"tensors autograd saved for a backward during {function}"


def launched_keys(function: str) -> tuple[str, str, str]:
    """`(launches, written, outside)`: `TritonLaunches`' count and stored results, and the widest reduction
    outside the kernels (`Reductions`)."""
    return (f"Triton kernels launched by {function}", "results stored by a Triton kernel",
            f"most values one PyTorch reduction combined in {function}, outside its kernels")


def reduction_keys(function: str) -> tuple[str, str]:
    """`(widest, limit)`: the most values one reduction combined during `function` (`Reductions`), and a block."""
    return f"most values one reduction combined during {function}", "block_size"


def keys_in_blocks_keys(function: str) -> tuple[str, str]:
    """`(widest, limit)`: as `reduction_keys`, held against a block of keys or a head's width."""
    return f"most values one reduction combined during {function}", "max(block_k, head dimension)"
