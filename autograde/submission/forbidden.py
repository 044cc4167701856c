"""Find the functions an exercise does not allow: statically in the source, and by a tripwire.

`scan` reads the submission's code (an AST walk, nothing runs) and is what the trusted
process relies on. `Tripwire` records calls while the submission runs, which catches what the
source hides: as a torch function mode, aliases, `getattr` and a module calling one for you (as
`nn.MultiheadAttention` calls `F.multi_head_attention_forward`); by replacing the kernels of the
operators underneath (`aten._softmax`, PyTorch's attention kernels) in the dispatcher, those
operators however they were reached, `torch.ops.aten` or `DisableTorchFunction` included. The
tripwire runs in the learner's process, which can switch it off: it is advisory, and the scan and
the rules' tests are what count.
Names are qualified: `torch.nn.functional.softmax`, `torch.Tensor.softmax`, and
`torch.nn.MultiheadAttention.forward` for calling an instance of that module.
"""

from __future__ import annotations

import ast
import importlib
import traceback
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode

from autograde.sandbox.observe import learner_line


@dataclass(frozen=True)
class Violation:
    name: str
    where: str

    def describe(self) -> str:
        return f"uses {self.name}" + (f" ({self.where})" if self.where else "")


class ForbiddenCall(RuntimeError):
    pass


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _torch_aliases(trees: Iterable[ast.AST]) -> set[str]:
    """Names bound to torch or one of its submodules (`torch`, `F`, `nn`, ...)."""
    aliases = {"torch"}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "torch":
                        aliases.add(alias.asname or "torch")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def _instance_calls(tree: ast.AST, cls: str) -> Iterable[ast.AST]:
    """Calls of instances of `cls`: `cls(...)(x)`, `m = cls(...)` then `m(x)` or `m.forward(x)`."""
    def constructs(node) -> bool:
        return isinstance(node, ast.Call) and (_dotted(node.func) or "").split(".")[-1] == cls

    instances = {
        _dotted(target)
        for node in ast.walk(tree) if isinstance(node, ast.Assign) and constructs(node.value)
        for target in node.targets
    } - {None}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = _dotted(node.func)
        if constructs(node.func) or called in instances or (
            called and called.endswith(".forward") and called.removesuffix(".forward") in instances
        ):
            yield node


def _uses(tree: ast.AST, name: str, torch_names: set[str]) -> Iterable[ast.AST]:
    parts = name.split(".")
    attribute = parts[-1]
    if attribute == "forward":
        yield from _instance_calls(tree, parts[-2])
        return
    tensor_method = parts[-2] == "Tensor"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == attribute:
            root = _root(node.value)
            if (root not in ("self", "cls")) if tensor_method else (root in torch_names):
                yield node
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(alias.name == attribute for alias in node.names):
                yield node
        elif (isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == attribute):
            yield node


def _bound_names(statement: ast.stmt) -> list[str]:
    """The names a top-level statement binds: a def or class, an assignment's targets, an import."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in statement.names]
    targets = statement.targets if isinstance(statement, ast.Assign) else \
        [statement.target] if isinstance(statement, (ast.AnnAssign, ast.AugAssign)) else []
    return [node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)]


Parsed = list[tuple[str, list[str], ast.AST]]  # (label, lines, tree) of each cell


def reachable(parsed: Parsed, roots: Iterable[str]) -> Parsed:
    """The top-level statements that define `roots` and every name they use, transitively, as the
    notebook leaves them (a later definition replaces an earlier one)."""
    definitions: dict[str, list] = {}
    for label, lines, tree in parsed:
        for statement in tree.body:
            for name in _bound_names(statement):
                definitions[name] = [(label, lines, statement)]
    found, seen, waiting = [], set(), list(roots)
    while waiting:
        name = waiting.pop()
        if name in seen or name not in definitions:
            continue
        seen.add(name)
        for label, lines, statement in definitions[name]:
            if all(statement is not other for _, _, other in found):
                found.append((label, lines, statement))
            waiting += [node.id for node in ast.walk(statement) if isinstance(node, ast.Name)]
    return found


def scan(cells: Iterable[tuple[str, str]], not_allowed: Iterable[str],
         roots: Iterable[str] | None = None) -> list[Violation]:
    """Violations in `cells`, pairs of (label such as 'cell 5', source); unparsable cells are skipped.

    With `roots` (the exercise's functions), only the code they reach counts: their definitions
    and what those use, transitively. One violation per line, however many names it matches.
    """
    not_allowed = list(not_allowed)
    return _found(cells, roots, lambda tree, torch_names: (
        (node, name) for name in not_allowed for node in _uses(tree, name, torch_names)))


def _found(cells: Iterable[tuple[str, str]], roots: Iterable[str] | None, finds) -> list[Violation]:
    """What `finds(tree, torch_names)` yields as (node, name) in the parsable cells (in the code
    `roots` reach, if given), one violation per line, in the notebook's order."""
    parsed = []
    for label, source in cells:
        try:
            parsed.append((label, source.splitlines(), ast.parse(source)))
        except SyntaxError:
            continue
    torch_names = _torch_aliases(tree for _, _, tree in parsed)
    found: list[Violation] = []
    places: set[str] = set()
    for label, lines, tree in parsed if roots is None else reachable(parsed, roots):
        for node, name in finds(tree, torch_names):
            where = f"{label}, line {node.lineno}: `{lines[node.lineno - 1].strip()}`"
            if where not in places:
                places.add(where)
                found.append(Violation(name, where))
    return sorted(found, key=lambda violation: _order(violation, [label for label, _, _ in parsed]))


def _order(violation: Violation, labels: list[str]) -> tuple[int, int]:
    label, _, rest = violation.where.partition(", line ")
    return (labels.index(label) if label in labels else len(labels), int(rest.split(":")[0] or 0))


def scan_graded(cells: Iterable[tuple[str, str]], exercise) -> tuple[list[Violation], list[Violation]]:
    """Not-allowed uses in the code the exercise's functions reach (they cost the exercise), and
    elsewhere in the notebook (a check of the learner's own, say: a note, not a zero)."""
    cells = list(cells)
    graded = scan(cells, exercise.not_allowed, roots=exercise.required)
    elsewhere = [v for v in scan(cells, exercise.not_allowed) if v.where not in {g.where for g in graded}]
    return graded, elsewhere


# What honest attention code has no reason to touch, and what goes around the scan and the
# tripwire: torch's private parts and dispatch machinery, the module table, importing or running
# code from strings. Found in the code the graded functions reach, it is shown to the instructor.
_MACHINERY = ("torch.ops", "torch.overrides", "torch.library", "torch.utils._python_dispatch")
_RUNS_STRINGS = {"exec", "eval", "compile", "__import__"}


def _torch_internal(dotted: str, torch_names: set[str]) -> bool:
    root, *parts = dotted.split(".")
    if root not in torch_names:
        return False
    named = ".".join(["torch", *parts])
    return any(part.startswith("_") and not part.startswith("__") for part in parts) or \
        any(named == m or named.startswith(m + ".") for m in _MACHINERY)


def _internals(tree: ast.AST, torch_names: set[str]) -> Iterable[tuple[ast.AST, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and (dotted in ("sys.modules", "sys._getframe") or _torch_internal(dotted, torch_names)):
                yield node, dotted
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported = [f"{node.module}.{alias.name}" for alias in node.names] if isinstance(node, ast.ImportFrom) \
                else [alias.name for alias in node.names]
            yield from ((node, name) for name in imported
                        if name.split(".")[0] in ("importlib", "ctypes") or _torch_internal(name, {"torch"}))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in _RUNS_STRINGS or node.func.id == "getattr" and len(node.args) > 1 and \
                    _root(node.args[0]) in torch_names and not isinstance(node.args[1], ast.Constant):
                yield node, f"{node.func.id}(...)"


def review(cells: Iterable[tuple[str, str]], exercise) -> list[Violation]:
    """Dynamic access to torch's internals in the code the exercise's functions reach: no rule is
    broken by itself, but it can go around the tripwire and the rules, so a person should look."""
    return _found(cells, exercise.required, _internals)


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


# The operators underneath a not-allowed function, by the contract's name for it: what reaches
# them is that function, under whatever name (PyTorch's attention kernels, and `_safe_softmax`,
# the softmax of its unfused attention; the softmax family's operators).
_OPERATORS = {
    "torch.nn.functional.scaled_dot_product_attention": (
        "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
        "_safe_softmax"),
    "torch.nn.functional.multi_head_attention_forward": ("_native_multi_head_attention",),
    "torch.softmax": ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "logsumexp"),
}


def operators(not_allowed: Iterable[str]) -> dict:
    """The aten operators that `not_allowed` rules out, each with the name it is reported under."""
    found = {}
    for name in not_allowed:
        for operator in _OPERATORS.get(name, ()):
            packet = getattr(torch.ops.aten, operator, None)  # absent from some builds
            if packet is not None:
                found.setdefault(packet, f"{name} (as torch.ops.aten.{operator})")
    return found


class Tripwire(TorchFunctionMode):
    """While active, a call of a not-allowed torch function, or of an operator underneath one, is
    recorded and raises ForbiddenCall."""

    def __init__(self, not_allowed: Iterable[str]):
        super().__init__()
        not_allowed = tuple(not_allowed)
        self.targets = {resolve(name): name for name in not_allowed}
        self.violations: list[Violation] = []
        self._operators = _OperatorTripwire(self, operators(not_allowed))

    def __enter__(self):
        self._operators.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._operators.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._operators.__exit__(*exc_info)

    def stop(self, name: str):
        violation = Violation(name, learner_line(traceback.extract_stack()))
        if violation not in self.violations:
            self.violations.append(violation)
        raise ForbiddenCall(f"{name} is not allowed in this exercise")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            name = self.targets.get(func)
        except TypeError:  # an unhashable callable is none of ours
            name = None
        if name is not None:
            self.stop(name)
        return func(*args, **(kwargs or {}))


# The dispatch keys an operator's kernels are registered under: each device's, and the composite
# ones that serve every device. Replacing every kernel an operator has stops it on any device,
# with or without autograd, under `no_grad` and `inference_mode`.
_KERNEL_KEYS = ("CPU", "CUDA", "MPS", "XPU", "NestedTensorCPU", "NestedTensorCUDA", "SparseCPU", "SparseCUDA",
                "CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def _kernels_of(packet) -> Iterable[tuple[str, str]]:
    """(overload, dispatch key) of each kernel registered for an operator, e.g. ("_softmax.out", "CPU")."""
    for overload in packet.overloads():
        name = packet.__name__ if overload == "default" else f"{packet.__name__}.{overload}"
        for key in _KERNEL_KEYS:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
                yield name, key


class _OperatorTripwire:
    """The dispatcher's half of a `Tripwire`: while entered, every kernel of the not-allowed
    operators is replaced by one that stops the call, so no alias and no way of calling goes
    around it. Only those operators change; every other one runs at full speed, which a
    dispatch mode seeing every operator in Python would not allow."""

    def __init__(self, owner: Tripwire, targets: dict):
        self.owner = owner
        self._kernels = [(overload, key, name) for packet, name in targets.items()
                         for overload, key in _kernels_of(packet)]  # (overload, dispatch key, name reported)
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
