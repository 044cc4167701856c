"""Rules on how a result is computed, beyond its values: measured by an adapter, judged by a test.

Equal values cannot show that an attention kernel never builds the full score matrix, or
skips the blocks that a causal mask hides. An adapter therefore measures the learner's call and
reports numbers as observations; a test then judges them with the `Rule` against a limit. The
limit is read from the reference's observations (the same adapter computes it from the
inputs), never from the process that ran the learner's code.

Measurements:
- `Footprint`: the largest tensor created during a call (every tensor an operator returns,
  views included, by number of elements) and the matmul FLOPs, counted with the formulas
  of `torch.utils.flop_counter.FlopCounterMode`;
- `saved_for_backward`: what an autograd Function's forward kept for its backward;
- `TritonLaunches`: how many Triton kernels a call launched, compiled or interpreted, and the
  values they left in the tensors they were given;
- `Reductions`: the most values that one reduction (a max, a sum, a matrix product, ...)
  combined into one result during a call.

These are measured in the learner's own process, whose code could switch them off: they are
advisory. Two rules are also measured from outside it, from `CallCost`: how far the memory of
the learner's processes rose during a call, what they read or wrote of the memory they held, and
the CPU time they spent, read by the fork server
from the kernel's counters (`sandbox.server._CostWatch`), which also sees a process start or end;
`whole_scores` and `work_time` judge them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable

import torch
from torch.utils import _python_dispatch, _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autograde import triton_interpreter
from autograde.sandbox.observe import ContractError

# The matrix products of FlopCounterMode's table; its attention and convolution entries have no place here.
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class Footprint(TorchDispatchMode):
    """While active: the largest tensor any operator returns, the elements of all but views, and the
    matmul FLOPs spent.

    FLOPs follow `FlopCounterMode`'s formulas (2 m n k per product). Counting them here
    rather than running `FlopCounterMode` itself gives the same numbers for these operators
    at a fraction of the cost: `FlopCounterMode` tries to decompose every other operator.
    """

    def __init__(self):
        super().__init__()
        # Imported here, not with this module: it imports Triton, which must not be imported
        # before the grading process has chosen whether to interpret kernels (see flash_triton).
        from torch.utils.flop_counter import flop_registry

        self.formulas = {op: flop_registry[op] for op in _MATMULS}
        self.largest = 0
        self.produced = 0  # elements computed: of every tensor returned but views, however the work is split
        self.matmul_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for value in _pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
                if not func.is_view:
                    self.produced += value.numel()
        if func.overloadpacket in self.formulas:
            self.matmul_flops += self.formulas[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


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


class Reductions(TorchDispatchMode):
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


# Rules.

@dataclass(frozen=True)
class Rule:
    """A rule on how a result is computed, which equal values cannot show (memory, work, ...).

    The adapter reports what the rule needs as observations named in `keys`; a test holds them
    against the limits with `autograde.testing.assert_rule`, which calls `judge(expected, got)`:
    the problems found, each naming the rule and saying by how much it is broken. Limits are
    read from `expected`, computed by the same adapter on the reference's side.
    """

    name: str
    keys: tuple[str, ...]
    judge: Callable[[dict, dict], list[str]]


def _number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def memory(function: str) -> tuple[Rule, str, str]:
    """The memory rule of the flash exercises, with the keys its probe reports:
    `(rule, largest_key, limit_key)`."""
    largest = f"largest tensor created by {function} (elements)"
    limit = "max(q.numel(), k.numel(), v.numel(), B*H*block_q*block_k)"

    def judge(expected: dict, got: dict) -> list[str]:
        measured, allowed = got[largest], expected[limit]
        if not _number(measured):
            return [f"memory rule: `{largest}` should be a number, got {measured!r}"]
        if measured <= allowed:
            return []
        return [f"memory rule broken: the largest tensor created by {function} holds {measured:,} elements, "
                f"{measured / allowed:.3g}x the {allowed:,} allowed ({limit}); the reference's largest holds "
                f"{expected[largest]:,}. Work on one block of scores at a time: never all L x S at once."]

    return Rule("memory", (largest,), judge), largest, limit


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


def whole_scores(call: str, peak: CallCost, scores: int) -> list[str]:
    """The problems with `peak`, measured during `call`, for inputs with `scores` attention scores
    (B * H * L * S): the memory it gained and the writable memory it read or wrote, together, must
    stay below what all of them would take at two bytes each.

    A stored float32 or float16 score matrix breaks it, whether in one tensor, in blocks kept (say,
    on `ctx`), in a buffer allocated before the call or in another process; working memory of the
    size of q, k, v, or of the output once per key block of at least 2 d columns, stays well below
    it (new pages count twice, gained and written: about 10 MiB for the reference's forward)."""
    if peak.problem:
        return [f"whole-scores rule: {peak.problem}"]
    allowed = 2 * scores
    if peak.growth_bytes is not None and peak.growth_bytes + peak.referenced_bytes < allowed:
        return []
    return [f"whole-scores rule broken: during {call} your notebook's processes gained "
            f"{peak.growth_bytes / 2**20:.0f} MiB of memory and read or wrote {peak.referenced_bytes / 2**20:.0f} MiB "
            f"of the writable memory they held ({peak.where}); all {scores:,} scores would take "
            f"{allowed / 2**20:.0f} MiB at two bytes each, {2 * allowed / 2**20:.0f} MiB as float32. "
            "Keep one block of scores at a time, and do not keep the blocks either."]


def work_time(call: str, causal: list[CallCost], full: list[CallCost], allowed: float) -> list[str]:
    """The problems with the CPU time of `call` measured with causal=True (`causal`) and with
    causal=False (`full`), a few times each, alternately: the fastest causal call must take at most
    `allowed` times the fastest full one.

    Skipping the key blocks wholly above the diagonal halves the work at L = S (0.54x for the
    reference, at L = S = 4096, blocks 128); masking them keeps all of it, however it is computed."""
    problems = [cost.problem for cost in causal + full if cost.problem]
    if problems:
        return [f"work rule: {problems[0]}"]
    fastest_causal, fastest_full = min(c.cpu_seconds for c in causal), min(c.cpu_seconds for c in full)
    if fastest_full <= 0:
        return [f"work rule: no CPU time measured for {call} with causal=False"]
    measured = fastest_causal / fastest_full
    if measured <= allowed:
        return []
    return [f"work rule broken: {call} took {fastest_causal:.2f} s of CPU time with causal=True, {measured:.2g}x the "
            f"{fastest_full:.2f} s with causal=False (the fastest of {len(causal)} calls each, {causal[0].where}); "
            f"at most {allowed:g}x is allowed. Skip the key blocks wholly above the diagonal instead of computing "
            "and masking them."]


def work() -> tuple[Rule, str, str, str]:
    """The work rule of `flash_attention_forward`, with the keys its probe reports:
    `(rule, causal_flops_key, full_flops_key, allowed_key)`."""
    causal = "matmul FLOPs with causal=True"
    full = "matmul FLOPs with causal=False"
    allowed = "largest ratio allowed"

    def judge(expected: dict, got: dict) -> list[str]:
        if not (_number(got[causal]) and _number(got[full])):
            return [f"work rule: the FLOP counts should be numbers, got {got[causal]!r} and {got[full]!r}"]
        if got[full] <= 0:
            return ["work rule: no matmul FLOPs counted with causal=False: compute the scores and the output "
                    "with matrix products (`@`, `torch.matmul`, `torch.einsum`), the operations counted"]
        measured = got[causal] / got[full]
        if measured <= expected[allowed]:
            return []
        return [f"work rule broken: with causal=True the forward spends {got[causal]:,} matmul FLOPs, "
                f"{measured:.3g}x the {got[full]:,} of causal=False; at most {expected[allowed]:g}x is allowed "
                f"(the reference: {expected[causal] / expected[full]:.3g}x). Skip the key blocks wholly above "
                "the diagonal instead of computing and masking them."]

    return Rule("work", (causal, full, allowed), judge), causal, full, allowed


def saved(function: str) -> tuple[Rule, str]:
    """The rule on what `function`'s forward saves for the backward, with the key its probe reports."""
    key = f"tensors {function}'s forward saves for backward"

    def judge(expected: dict, got: dict) -> list[str]:
        if got[key] == expected[key]:
            return []
        return [f"saved-tensors rule broken: {function}'s forward saves {got[key]}; it must save exactly "
                f"{expected[key]}, and the backward recomputes the probabilities block by block from lse."]

    return Rule("saved tensors", (key,), judge), key


def by_hand(function: str) -> tuple[Rule, str]:
    """The rule that `function` computes its gradients by hand, with the key its probe reports: no
    autograd graph recorded while it runs (`AutogradRecorded`)."""
    key = f"tensors autograd saved for a backward during {function}"

    def judge(expected: dict, got: dict) -> list[str]:
        if _number(got[key]) and got[key] == 0:
            return []
        return [f"hand-written backward rule broken: during {function}, autograd recorded a graph to differentiate "
                f"({got[key]!r} tensors saved for its backward); the gradients are the exercise: compute them by "
                "hand, block by block, not with torch.autograd.grad or .backward() on a recomputed forward."]

    return Rule("hand-written backward", (key,), judge), key


def launched(function: str) -> tuple[Rule, str, str, str]:
    """The rule that `function` computes with a Triton kernel, with the keys its probe reports:
    `(rule, launches_key, written_key, outside_key)`: the launches that ran to the end, which
    results hold values a launch stored (all it stored in one tensor, or a part: a view, slice or
    copy), and the most values one PyTorch reduction combined outside
    the kernels (the wrapper should only allocate, reshape and launch), with that reduction under
    `outside_key + " (call)"`."""
    launches = f"Triton kernels launched by {function}"
    written = "results stored by a Triton kernel"
    outside = f"most values one PyTorch reduction combined in {function}, outside its kernels"

    def judge(expected: dict, got: dict) -> list[str]:
        if not (_number(got[launches]) and got[launches] >= 1):
            return [f"Triton rule broken: {function} launched {got[launches]!r} Triton kernels; the result must "
                    "come from a `@triton.jit` kernel launched as `kernel[grid](...)`."]
        problems = []
        if got[written] != expected[written]:
            problems.append(f"Triton rule broken: of the results of {function}, {expected[written]} should hold "
                            f"values a Triton kernel stored in a tensor it was given, and {got[written]} do; the "
                            "kernel must store the results (`tl.store`) in tensors the wrapper returns (or views, "
                            "slices or copies of part of them).")
        if not (_number(got[outside]) and got[outside] <= expected[outside]):
            problems.append(f"Triton rule broken: outside its kernels, {function} combined {got[outside]!r} "
                            f"values in one PyTorch reduction ({got.get(outside + ' (call)', 'a reduction')}); "
                            "the scores, the softmax and the products with v belong in the kernel, and the "
                            "wrapper only allocates, reshapes and launches.")
        return problems

    return Rule("Triton kernel", (launches, written, outside, outside + " (call)"), judge), launches, written, outside


def reductions(function: str) -> tuple[Rule, str, str]:
    """The rule that `function` reads its input in blocks, with the keys its probe reports:
    `(rule, widest_key, limit_key)`; the probe also reports the widest call under `widest_key + " (call)"`."""
    widest = f"most values one reduction combined during {function}"
    limit = "block_size"

    def judge(expected: dict, got: dict) -> list[str]:
        measured, allowed = got[widest], expected[limit]
        if not _number(measured):
            return [f"block rule: `{widest}` should be a number, got {measured!r}"]
        if measured <= allowed:
            return []
        return [f"block rule broken: one reduction in {function} combined {measured:,} values "
                f"({got.get(widest + ' (call)', 'a reduction')}), more than the block_size={allowed:,} columns of "
                "one block. Read the row one block of columns at a time: a running max and a running sum, "
                "updated block by block, never a max or a sum over the whole row."]

    return Rule("block", (widest,), judge), widest, limit
