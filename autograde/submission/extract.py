"""The code a submission defines: its code cells, without notebook-only syntax or the release's checks.

Skipped: the nbgrader test cells and the self-check cells of the release (identified by
their nbgrader metadata), IPython magics and shell lines, and calls of `check(...)` with
the `autograde` imports they need. Removed lines become `pass` or blank lines so that line
numbers in feedback match what the learner sees.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nbformat is imported by who reads notebooks (`notebook.load`): see `notebook.skip_iri_grammars`
    import nbformat

# Cell magics whose body is still Python and still runs.
PYTHON_CELL_MAGICS = ("time", "timeit", "capture", "prun")
_MAGIC = re.compile(r"^(\s*)(%|!|\w+\s*=\s*[!%])")


@dataclass(frozen=True)
class Cell:
    number: int  # position in the notebook, counting every cell from 1
    source: str
    run_as: int | None = None  # its execution count when saved, which Jupyter shows beside it as [7]

    @property
    def label(self) -> str:
        """'cell 5 (In [7])': where it is, and the number `check()` names it by in the kernel."""
        return cell_label(self.number, self.run_as)


def cell_label(number: int, run_as: int | None = None) -> str:
    return f"cell {number}" + (f" (In [{run_as}])" if run_as else "")


def is_release_check(cell: nbformat.NotebookNode) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    autograder_test = bool(meta.get("grade")) and not meta.get("solution")
    return autograder_test or str(meta.get("grade_id", "")).startswith("check")


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def without_magics(source: str) -> str | None:
    """`source` with magics and shell lines turned into `pass`; None for a non-Python cell magic."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        if lines[0][2:].split(" ")[0] not in PYTHON_CELL_MAGICS:
            return None
        lines[0] = ""
    if _parses("\n".join(lines)):  # plain Python, whatever its lines start with
        return "\n".join(lines)
    return "\n".join(
        f"{match.group(1)}pass" if (match := _MAGIC.match(line)) else line for line in lines
    )


def _is_check_statement(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return all(alias.name.split(".")[0] == "autograde" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "autograde"
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id in ("check", "run"))


def without_checks(source: str) -> str:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # running it reports the error where the learner can find it
    lines = source.splitlines()
    for node in tree.body:
        if _is_check_statement(node):
            for index in range(node.lineno - 1, node.end_lineno):
                lines[index] = ""
    return "\n".join(lines)


def code_cells(notebook: nbformat.NotebookNode) -> list[Cell]:
    cells = []
    for number, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code" or is_release_check(cell):
            continue
        source = without_magics(cell.source)
        if source is not None and source.strip():
            count = cell.get("execution_count")
            cells.append(Cell(number, without_checks(source), count if type(count) is int and count > 0 else None))
    return cells
