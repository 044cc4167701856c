"""The reference implementations: the solution cells of the `solutions/` notebooks.

They are the course's own trusted code, so they run in the grading process itself, in
float64, to give the expected observations of each test case.
"""

from __future__ import annotations

import functools
import json
import linecache
from pathlib import Path

import torch

from autograde.cases import Case, Exercise, Inputs
from autograde.observe import Failure, run_probe

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def solution_cells(notebook: dict) -> list[str]:
    """The sources of the nbgrader solution cells of a notebook read as plain JSON."""
    return [
        "".join(cell["source"]) for cell in notebook["cells"]
        if cell["cell_type"] == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)
    ]


@functools.cache
def namespace(exercise: Exercise) -> dict:
    path = SOLUTIONS / exercise.notebook
    notebook = json.loads(path.read_text(encoding="utf-8"))
    names: dict = {"__name__": f"reference_{exercise.id}"}
    for index, source in enumerate(solution_cells(notebook)):
        filename = f"{path}:solution cell {index + 1}"
        # Kept for `inspect.getsource`, which Triton calls on the functions it decorates.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), names)
    return names


def expected(exercise: Exercise, case: Case, inputs: Inputs) -> dict:
    """The reference's observations for `case`, computed in float64."""
    result = run_probe(case.probe, namespace(exercise), inputs.cast(torch.float64))
    if isinstance(result, Failure):
        raise RuntimeError(f"the reference fails {exercise.id}/{case.name}: {result.describe()}")
    return result
