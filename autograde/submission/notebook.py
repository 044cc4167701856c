"""Read a submitted notebook, or say in one sentence why it cannot be graded."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import nbformat

MAX_BYTES = 20 * 2**20  # of a notebook's cells without their outputs
# Larger files are not even read. Between the two, the outputs are dropped before grading, as
# nbgrader's autograde clears them before it runs a notebook.
READ_BYTES = 256 * 2**20
CELL_TYPES = ("code", "markdown", "raw")


def skip_iri_grammars() -> None:
    """For the grader's own processes, before nbformat is first imported: nbformat's validator imports
    jsonschema, which compiles 39 grammars (0.8 s of every grading process's start) when rfc3987-syntax
    is installed, as Jupyter's packages install it, to check IRI formats that no notebook schema uses.
    Marked absent, jsonschema leaves those formats unchecked. Not done where a learner's kernel runs
    `check()`, which imports no nbformat, nor where the package is imported by other code."""
    sys.modules.setdefault("rfc3987_syntax", None)


class NotebookError(Exception):
    """The file is not a gradable notebook; the message is the reason, written for the learner."""


def _source_text(source) -> str | None:
    if isinstance(source, str):
        return source
    if isinstance(source, list) and all(isinstance(line, str) for line in source):
        return "".join(source)
    return None


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def load(path: Path) -> nbformat.NotebookNode:
    return load_with_notes(path)[0]


def load_with_notes(path: Path) -> tuple[nbformat.NotebookNode, tuple[str, ...]]:
    """The notebook, and what the learner should know about how it was read."""
    if not path.is_file():
        raise NotebookError(f"no file {path.name}")
    size = path.stat().st_size
    if size == 0:
        raise NotebookError(f"{path.name} is empty (0 bytes)")
    clear_outputs = "(clear its outputs: Edit > Clear Outputs of All Cells, then save)"
    if size > READ_BYTES:
        raise NotebookError(f"{path.name} is {_mib(size)}, more than the {_mib(READ_BYTES)} the grader reads "
                            f"{clear_outputs}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise NotebookError(f"{path.name} is not UTF-8 text, so not a notebook") from None
    except json.JSONDecodeError as exc:
        raise NotebookError(
            f"{path.name} is not a notebook: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:  # a number too long to read, or nesting too deep
        raise NotebookError(f"{path.name} is not a notebook: its JSON cannot be read ({type(exc).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise NotebookError(f"{path.name} is JSON but not a notebook (it has no list of cells)")
    if data.get("nbformat") != 4:
        version = data.get("nbformat")
        shown = version if isinstance(version, int) and abs(version) < 1000 else str(version)[:20]
        raise NotebookError(f"{path.name} has nbformat {shown!r}; version 4 is needed "
                            f"(open it in Jupyter and save it)")
    for number, cell in enumerate(data["cells"], 1):
        if not isinstance(cell, dict) or cell.get("cell_type") not in CELL_TYPES:
            raise NotebookError(f"{path.name}: cell {number} is not a code, markdown or raw cell")
        source = _source_text(cell.get("source"))
        if source is None:
            raise NotebookError(f"{path.name}: cell {number} has no text source")
        cell["source"] = source
        if not isinstance(cell.get("metadata", {}), dict):
            raise NotebookError(f"{path.name}: cell {number} has malformed metadata")
    notes = ()
    if size > MAX_BYTES:
        for cell in data["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
        stripped = len(json.dumps(data).encode("utf-8"))
        if stripped > MAX_BYTES:
            raise NotebookError(f"{path.name} is {_mib(size)}, and {_mib(stripped)} without its outputs: more than "
                                f"the {_mib(MAX_BYTES)} allowed")
        notes = (f"{path.name} is {_mib(size)}, more than the {_mib(MAX_BYTES)} allowed: it was graded without its "
                 f"outputs ({_mib(stripped)}); clear them before you submit {clear_outputs}",)
    import nbformat  # here, not at the top: `skip_iri_grammars`

    return nbformat.from_dict(data), notes
