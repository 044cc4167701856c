"""The reference implementations: the solution cells of the `solutions/` notebooks.

They are the course's own trusted code, so they run in the grading process itself, in
float64, behind the tests' `reference` fixture (`reference.Reference`).
"""

from __future__ import annotations

import functools
import json
import linecache

from autograde import course
from autograde.cases import Exercise


def solution_cells(notebook: dict) -> list[str]:
    """The sources of the nbgrader solution cells of a notebook read as plain JSON."""
    return [
        "".join(cell["source"]) for cell in notebook["cells"]
        if cell["cell_type"] == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)
    ]


@functools.cache
def namespace(exercise: Exercise) -> dict:
    path = course.solutions() / exercise.notebook
    notebook = json.loads(path.read_text(encoding="utf-8"))
    names: dict = {"__name__": f"reference_{exercise.id}"}
    for index, source in enumerate(solution_cells(notebook)):
        filename = f"{path}:solution cell {index + 1}"
        # Kept for `inspect.getsource`, which Triton calls on the functions it decorates.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), names)
    return names
