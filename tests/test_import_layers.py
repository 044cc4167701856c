"""The grader's layers (autograde/README.md, "How the grader works"): a module imports only from
its own layer and the layers below it. No import runs upward, and no two modules import each other,
however indirectly.

Every import counts, at the top of a module or deferred inside a function: a deferred import still
ties the two modules together. Importing the package `autograde` itself counts for nothing (it
loads its front ends only when one is asked for).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures.notebooks import ROOT

PACKAGE = ROOT / "autograde"
# Bottom to top. An exercise's definition (its `Exercise` and the adapters the worker runs on a
# submission) sits below the sandbox that runs it; its tests, and what they hold results against,
# sit above the sandbox and below the grading that runs them (whose pytest plugin is the conftest).
LAYERS = (
    ("foundation", ("autograde.cases", "autograde.course", "autograde.solutions", "autograde.triton_interpreter",
                    "autograde.observe")),
    ("definitions", ("autograde.registry", "autograde.exercises", "autograde.adapters", "autograde.rules.measure")),
    ("submission", ("autograde.submission",)),
    ("sandbox", ("autograde.sandbox",)),
    ("tests", ("autograde.tests", "autograde.testing", "autograde.compare", "autograde.rules",
               "autograde.misconceptions")),
    ("grading", ("autograde.grading", "autograde.tests.conftest")),
    ("front ends", ("autograde.frontends", "autograde.__main__")),
)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    """The index of the layer the longest matching prefix puts `module` in."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS (and to the README's drawing)"
    return max(matches)[1]


def imported(source: str) -> set[str]:
    """The package's modules a module's source imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "autograde":
            found |= {_module_of(f"{node.module}.{alias.name}") for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {_module_of(alias.name) for alias in node.names if alias.name.split(".")[0] == "autograde"}
    return found - {"autograde"}


def _module_of(dotted: str) -> str:
    """`autograde.compare.describe` -> `autograde.compare`: the longest prefix that is a module."""
    parts = dotted.split(".")
    return next(".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in MODULES
                or end == 1)


def module_graph() -> dict[str, set[str]]:
    """Each module of the package, and the package's modules it imports; the registry imports each
    exercise's definition by name (`importlib`), which the source does not spell out."""
    graph = {module: imported(path.read_text(encoding="utf-8")) - {module} for module, path in MODULES.items()
             if module != "autograde"}
    graph["autograde.registry"] |= {module for module in MODULES if module.startswith("autograde.exercises.")}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(module, target) for module, targets in graph.items() for target in targets
            if layer(target) > layer(module)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, however indirectly (Tarjan's strongly connected
    components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_is_in_a_layer():
    for module in MODULES:
        if module != "autograde":
            layer(module)


def test_no_import_runs_up_the_layers():
    upward = sorted(upward_imports(module_graph()))
    assert not upward, "imports against the layers (autograde/README.md): " + ", ".join(
        f"{a} -> {b}" for a, b in upward)


def test_no_modules_import_each_other():
    assert not cycles(module_graph())


def test_the_checks_see_an_upward_import_and_a_cycle():
    graph = module_graph()
    graph["autograde.sandbox.worker"] = graph["autograde.sandbox.worker"] | {"autograde.tests.test_sdpa"}
    assert ("autograde.sandbox.worker", "autograde.tests.test_sdpa") in upward_imports(graph)
    graph["autograde.exercises.sdpa"] = graph["autograde.exercises.sdpa"] | {"autograde.registry"}
    assert cycles(graph) == [["autograde.exercises.sdpa", "autograde.registry"]]
    assert layer("autograde.exercises.sdpa") < layer("autograde.sandbox.worker") < layer("autograde.tests.test_sdpa") \
        < layer("autograde.grading.session") < layer("autograde.frontends.cli")
    assert imported("from autograde.grading import report\ndef f():\n    import autograde.frontends.cli\n") == {
        "autograde.grading.report", "autograde.frontends.cli"}
