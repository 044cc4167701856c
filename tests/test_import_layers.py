"""The grader's layers (autograde/README.md, "How the grader works"): a module imports only from
its own layer and the layers below it. The imports that run upward today are listed, each with why,
as debts: a new one fails this test, and so does a listed one that is gone (strike it from the list).

Every import counts, at the top of a module or deferred inside a function: a deferred import still
ties the two modules together. Importing the package `autograde` itself counts for nothing (it
loads its front ends only when one is asked for).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures.notebooks import ROOT

PACKAGE = ROOT / "autograde"
# Bottom to top. The exercise definitions sit between running a submission and grading it: the
# worker runs their adapters, the grading process their tests; the tests' pytest plugin is grading's.
LAYERS = (
    ("foundation", ("autograde.cases", "autograde.course", "autograde.solutions", "autograde.triton_interpreter")),
    ("submission", ("autograde.submission",)),
    ("sandbox", ("autograde.sandbox",)),
    ("exercises", ("autograde.registry", "autograde.testing", "autograde.compare", "autograde.rules",
                   "autograde.misconceptions", "autograde.tests")),
    ("grading", ("autograde.grading", "autograde.tests.conftest")),
    ("front ends", ("autograde.frontends", "autograde.__main__")),
)
DEBTS = {
    ("autograde.sandbox.calls", "autograde.registry"): "the worker calls the adapters, defined in the test modules",
    ("autograde.sandbox.worker", "autograde.registry"): "the worker finds its exercise's adapters by id",
    ("autograde.sandbox.client", "autograde.registry"): "the client reads an exercise's environment and GPU flag",
    ("autograde.submission.locate", "autograde.registry"): "which notebooks answer which exercise",
}


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


def upward_imports() -> set[tuple[str, str]]:
    return {(module, target) for module, path in MODULES.items() if module != "autograde"
            for target in imported(path.read_text(encoding="utf-8")) if layer(target) > layer(module)}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        if module != "autograde":
            layer(module)


def test_no_import_runs_up_the_layers_but_the_known_debts():
    found = upward_imports()
    new = sorted(found - DEBTS.keys())
    paid = sorted(DEBTS.keys() - found)
    assert not new, "imports against the layers (autograde/README.md): " + ", ".join(f"{a} -> {b}" for a, b in new)
    assert not paid, "debts paid, strike them from DEBTS: " + ", ".join(f"{a} -> {b}" for a, b in paid)


def test_the_check_sees_an_upward_import():
    assert ("autograde.sandbox.worker", "autograde.registry") in upward_imports()
    assert layer("autograde.sandbox.worker") < layer("autograde.grading.session") < layer("autograde.frontends.cli")
    assert imported("from autograde.grading import report\ndef f():\n    import autograde.frontends.cli\n") == {
        "autograde.grading.report", "autograde.frontends.cli"}
