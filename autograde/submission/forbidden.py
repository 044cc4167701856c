"""Find the functions an exercise does not allow in a submission's source, nothing run.

`scan` reads the submission's code (an AST walk) and is what the trusted process relies on;
`review` shows a person the reflection and concurrency that could go around the tripwire
(`autograde.sandbox.tripwire`, which catches at run time what the source hides) unseen.
Names are qualified: `torch.nn.functional.softmax`, `torch.Tensor.softmax`, and
`torch.nn.MultiheadAttention.forward` for calling an instance of that module.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Violation:
    name: str
    where: str

    def describe(self) -> str:
        return f"uses {self.name}" + (f" ({self.where})" if self.where else "")


@functools.lru_cache(maxsize=8192)
def _walked(node: ast.AST) -> tuple[ast.AST, ...]:
    """`ast.walk(node)`, kept for a notebook's scans and review, which read each statement several
    times (walking is what they spend their time on; the trees are read, never changed)."""
    return tuple(ast.walk(node))


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
        for node in _walked(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "torch":
                        aliases.add(alias.asname or "torch")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def _instance_calls(nodes: tuple[ast.AST, ...], cls: str) -> Iterable[ast.AST]:
    """Calls of instances of `cls`: `cls(...)(x)`, `m = cls(...)` then `m(x)` or `m.forward(x)`."""
    def constructs(node) -> bool:
        return isinstance(node, ast.Call) and (_dotted(node.func) or "").split(".")[-1] == cls

    instances = {
        _dotted(target)
        for node in nodes if isinstance(node, ast.Assign) and constructs(node.value)
        for target in node.targets
    } - {None}
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        called = _dotted(node.func)
        if constructs(node.func) or called in instances or (
            called and called.endswith(".forward") and called.removesuffix(".forward") in instances
        ):
            yield node


class _Nodes:
    """A tree's nodes, with those `_uses` reads filed by the name they would match."""

    def __init__(self, tree: ast.AST):
        self.all = _walked(tree)
        self.attributes: dict[str, list[ast.Attribute]] = defaultdict(list)
        self.torch_imports: list[ast.ImportFrom] = []
        self.getattrs: dict[str, list[ast.Call]] = defaultdict(list)  # getattr(x, "name") by name
        for node in self.all:
            if isinstance(node, ast.Attribute):
                self.attributes[node.attr].append(node)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                self.torch_imports.append(node)
            elif (isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                self.getattrs[node.args[1].value].append(node)


def _uses(nodes: _Nodes, name: str, torch_names: set[str]) -> Iterable[ast.AST]:
    parts = name.split(".")
    attribute = parts[-1]
    if attribute == "forward":
        yield from _instance_calls(nodes.all, parts[-2])
        return
    tensor_method = parts[-2] == "Tensor"
    for node in nodes.attributes.get(attribute, ()):
        root = _root(node.value)
        if (root not in ("self", "cls")) if tensor_method else (root in torch_names):
            yield node
    for node in nodes.torch_imports:
        if any(alias.name == attribute for alias in node.names):
            yield node
    yield from nodes.getattrs.get(attribute, ())


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


def reachable(parsed: Parsed, roots: Iterable[str], also=lambda statement: False) -> Parsed:
    """The top-level statements that define `roots` and every name they use, transitively, as the
    notebook leaves them (a later definition replaces an earlier one); and those for which `also` holds."""
    definitions: dict[str, list] = {}
    found = []
    for label, lines, tree in parsed:
        for statement in tree.body:
            for name in _bound_names(statement):
                definitions[name] = [(label, lines, statement)]
            if also(statement):
                found.append((label, lines, statement))
    seen, waiting = set(), list(roots)
    while waiting:
        name = waiting.pop()
        if name in seen or name not in definitions:
            continue
        seen.add(name)
        for label, lines, statement in definitions[name]:
            if all(statement is not other for _, _, other in found):
                found.append((label, lines, statement))
            waiting += [node.id for node in _walked(statement) if isinstance(node, ast.Name)]
    return found


def scan(cells: Iterable[tuple[str, str]], not_allowed: Iterable[str],
         roots: Iterable[str] | None = None) -> list[Violation]:
    """Violations in `cells`, pairs of (label such as 'cell 5', source); unparsable cells are skipped.

    With `roots` (the exercise's functions), only the code they reach counts: their definitions
    and what those use, transitively. One violation per line, however many names it matches.
    """
    not_allowed = list(not_allowed)

    def finds(tree: ast.AST, torch_names: set[str]) -> Iterable[tuple[ast.AST, str]]:
        nodes = _Nodes(tree)
        # One violation per line: the nodes of one name on one line are the same violation.
        return ((node, name) for name in not_allowed for node in _uses(nodes, name, torch_names))

    return _found(cells, roots, finds)


def _parsed(cells: Iterable[tuple[str, str]]) -> tuple[Parsed, set[str]]:
    """The parsable cells, and the names bound to torch in them: once for a notebook's scans and review
    (kept for the last two notebooks; the trees are read, never changed)."""
    return _parsed_once(tuple((label, source) for label, source in cells))


@functools.lru_cache(maxsize=2)
def _parsed_once(cells: tuple[tuple[str, str], ...]) -> tuple[Parsed, set[str]]:
    parsed = []
    for label, source in cells:
        try:
            parsed.append((label, source.splitlines(), ast.parse(source)))
        except SyntaxError:
            continue
    return parsed, _torch_aliases(tree for _, _, tree in parsed)


def _found(cells: Iterable[tuple[str, str]], roots: Iterable[str] | None, finds,
           also=lambda statement: False) -> list[Violation]:
    """What `finds(tree, torch_names)` yields as (node, name) in the parsable cells (in the code
    `roots` reach, and the top-level statements `also` accepts, if given), one violation per line,
    in the notebook's order."""
    parsed, torch_names = _parsed(cells)
    found: list[Violation] = []
    places: set[str] = set()
    for label, lines, tree in parsed if roots is None else reachable(parsed, roots, also):
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


# What honest attention code has no reason to touch, and what goes around the scan, the tripwire
# and the rules measured in the worker: torch's private parts and dispatch machinery, the module
# table, namespaces read by key, reflection, other threads and processes, code from strings.
# Found in the code the graded functions reach (or that runs at import and changes objects), it is
# shown to the instructor, each construct with one line on why it matters.
_MACHINERY = ("torch.ops", "torch.overrides", "torch.library", "torch.utils._python_dispatch")
_TORCH_INTERNALS = "torch's private parts and dispatch machinery can switch off the tripwire and the rules' modes"
_THREADS = "work in another thread escapes the rules, which watch the calling thread"
_PROCESSES = "work in another process escapes the tripwire and the rules measured in this one"
_FRAMES = "frames and code objects reach the grader's own objects in the process, the tripwire included"
_NAMESPACES = "a namespace read or changed by key hands out functions under no name the scan reads"
_BY_NAME = "an attribute fetched by a name the scan does not read, or a private one"
_PATCHES = "changes an attribute by name (a library's function replaced, say)"
_STRINGS = "runs code the scan never reads"
_OUTSIDE_TORCH = "computes outside torch, where the rules measured in the learner's process do not look"
_MODULES = {  # shown where imported
    "importlib": "imports a module by a name built at run time, around the scan",
    "ctypes": "calls C directly, around torch, the tripwire and the rules",
    "gc": "the garbage collector hands out every object of the process, the grader's tripwire included",
    "threading": _THREADS, "_thread": _THREADS, "concurrent": _THREADS,
    "multiprocessing": _PROCESSES, "subprocess": _PROCESSES,
    "inspect": _FRAMES,
    "builtins": "hands out getattr, __import__ and the other builtins under names the scan does not read",
}
_SYS = {"sys.modules": "the module table hands out any module, under no name the scan reads",
        "sys._getframe": _FRAMES, "sys._current_frames": _FRAMES, "sys.settrace": _FRAMES, "sys.setprofile": _FRAMES}
_CODE = "builds functions, modules or frames from code objects, around the scan"
_OTHER_CALLS = {"os.fork": _PROCESSES, "os.forkpty": _PROCESSES, "os.posix_spawn": _PROCESSES,
                "operator.attrgetter": _BY_NAME, "operator.methodcaller": _BY_NAME,
                **{f"types.{kind}": _CODE for kind in ("FunctionType", "LambdaType", "CodeType", "ModuleType",
                                                       "MethodType", "CellType", "FrameType", "TracebackType")}}
_REFLECTIVE_ATTRIBUTES = {"__dict__": _NAMESPACES, "__globals__": _FRAMES, "__closure__": _FRAMES, "__code__": _FRAMES,
                          "__builtins__": _NAMESPACES, "__subclasses__": _FRAMES, "tb_frame": _FRAMES,
                          "f_back": _FRAMES, "f_locals": _FRAMES, "f_globals": _FRAMES, "f_builtins": _FRAMES,
                          "gi_frame": _FRAMES, "cr_frame": _FRAMES, "ag_frame": _FRAMES}
_BUILTINS = {"exec": _STRINGS, "eval": _STRINGS, "compile": _STRINGS, "__import__": _STRINGS,
             "vars": _NAMESPACES, "globals": _NAMESPACES, "locals": _NAMESPACES,
             "getattr": _BY_NAME, "setattr": _PATCHES, "delattr": _PATCHES}


def _torch_internal(dotted: str, torch_names: set[str]) -> bool:
    root, *parts = dotted.split(".")
    if root not in torch_names:
        return False
    named = ".".join(["torch", *parts])
    return any(part.startswith("_") and not part.startswith("__") for part in parts) or \
        any(named == m or named.startswith(m + ".") for m in _MACHINERY)


def _module_names(trees: Iterable[ast.AST]) -> dict[str, str]:
    """Each name an import binds, with the module (or `module.name`) it is bound to."""
    names = {}
    for tree in trees:
        for node in _walked(tree):
            if isinstance(node, ast.Import):
                names.update({(alias.asname or alias.name.split(".")[0]): (alias.name if alias.asname
                              else alias.name.split(".")[0]) for alias in node.names})
            elif isinstance(node, ast.ImportFrom):
                names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    return names


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [f"{node.module}.{alias.name}" for alias in node.names]
    return [alias.name for alias in node.names]


def _flagged_name(name: str, torch_names: set[str], imported: bool = False) -> str | None:
    """Why a dotted name (`imported`, or an attribute chain with its root resolved) needs a person, or None.
    A module of `_MODULES` is shown where it is imported (which the code using it reaches)."""
    if name.split(".")[:2] == ["torch", "multiprocessing"]:
        return _PROCESSES
    if _torch_internal(name, torch_names):
        return _TORCH_INTERNALS
    if name in _SYS or name in _OTHER_CALLS:
        return _SYS.get(name) or _OTHER_CALLS[name]
    return _MODULES.get(name.split(".")[0]) if imported else None


def _private(name: ast.AST) -> bool:
    return isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_")


def _internals(tree: ast.AST, torch_names: set[str], modules: dict[str, str],
               outside_torch: bool = False) -> Iterable[tuple[ast.AST, str]]:
    """What `review` shows; with `outside_torch`, also numpy, imported or reached with `.numpy()`."""
    calls = {id(node.func): node for node in _walked(tree) if isinstance(node, ast.Call)}
    for node in _walked(tree):
        if outside_torch and isinstance(node, ast.Attribute) and node.attr == "numpy":
            yield node, f".numpy(): {_OUTSIDE_TORCH}"
        elif outside_torch and isinstance(node, (ast.Import, ast.ImportFrom)) and \
                any(name.split(".")[0] == "numpy" for name in _imported(node)):
            yield node, f"numpy: {_OUTSIDE_TORCH}"
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            root, _, rest = (dotted or "").partition(".")
            why = _REFLECTIVE_ATTRIBUTES.get(node.attr) or dotted and (
                _flagged_name(dotted, torch_names) or root in modules and _flagged_name(f"{modules[root]}.{rest}",
                                                                                        torch_names))
            if why:
                yield node, f"{dotted or '.' + node.attr}: {why}"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported(node):
                why = _flagged_name(name, {"torch"}, imported=True)
                if why:
                    yield node, f"{name}: {why}"
        elif isinstance(node, ast.Name) and node.id in _BUILTINS and node.id not in modules and \
                isinstance(node.ctx, ast.Load):
            call = calls.get(id(node))
            if call is None:
                yield node, f"{node.id} under another name: {_BUILTINS[node.id]}"
            elif node.id not in ("getattr", "setattr", "delattr"):
                yield node, f"{node.id}(...): {_BUILTINS[node.id]}"
            elif len(call.args) > 1:
                target, name = _root(call.args[0]), call.args[1]
                on_module = target in modules or target in torch_names
                if _private(name) or on_module and (node.id != "getattr" or not isinstance(name, ast.Constant)):
                    yield node, f"{node.id}(...): {_BUILTINS[node.id]}"


def _changes_objects_at_import(statement: ast.stmt) -> bool:
    """A top-level statement that runs when the notebook does and changes an object the graded code may
    use: an assignment to an attribute or an item (`torch.matmul = ...`), or a call of setattr."""
    for node in _walked(statement):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            return True
    return False


def review(cells: Iterable[tuple[str, str]], exercise) -> list[Violation]:
    """Reflection, concurrency and torch's internals in the code the exercise's functions reach, or in
    top-level code that changes objects when the notebook runs (and, where rules are measured in the
    learner's process, numpy): no rule is broken by itself, but it can go around the scan, the
    tripwire and the rules measured in the worker, so a person should look.
    Each is named with the reason it matters."""
    cells = list(cells)
    parsed = [tree for _, _, tree in _parsed(cells)[0]]
    modules = _module_names(parsed)
    patching = {name for tree in parsed for statement in tree.body if _changes_objects_at_import(statement)
                for name in _names_in(statement)}
    return _found(cells, [*exercise.required, *patching], lambda tree, torch_names: _internals(
        tree, torch_names, modules, exercise.rules_in_process), also=_changes_objects_at_import)


def _names_in(statement: ast.stmt) -> set[str]:
    return {node.id for node in _walked(statement) if isinstance(node, ast.Name)}
