"""Has a submission kept the released notebook's nbgrader cells? One sentence per difference.

The checks nbgrader makes when it validates and autogrades (cell types, locked flags, points,
checksums), made against the released notebook rather than the submission's own word: the
checksums are computed here from the submitted cells, since a learner can rewrite the stored
ones, and the metadata is read defensively, since a submission's JSON can hold anything.
Solution cells may change their source; locked and test cells may not, and no nbgrader cell may
change its metadata. Cells are matched by nbgrader grade_id, else by notebook cell id.

A notebook in nbgrader's source format (the instructor's, as in `solutions/`: no checksums, the
hidden tests in place) is said to be so, once, and compared as the release would have made it.
The findings are for the instructor; a learner is told one sentence (`FOR_THE_LEARNER`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autograde import course
from autograde.cases import Exercise

MAX_FINDINGS = 20  # then one line says how many more
MAX_CHARS = 300  # of one finding
FLAGS = ("grade", "solution", "locked", "task")

if TYPE_CHECKING:  # nbformat is imported where it is used: its validator takes seconds, which check() does without
    from nbformat.notebooknode import NotebookNode
FIELDS = ("points", *FLAGS, "cell_type")  # the nbgrader metadata compared with the release's
CELL_TYPES = ("code", "markdown", "raw")
ABSENT = object()  # a metadata key the cell does not have
CHANGED = "changed from the release: "  # how the grade's notes on tampered nbgrader cells start
FOR_THE_LEARNER = ("The notebook's locked cells or nbgrader metadata differ from the notebook you were given; "
                   "your instructor will look at it.")
SOURCE_FORMAT = ("the notebook is in nbgrader's source format (the instructor's version, with the solutions and "
                 "hidden tests, as in solutions/), not the released one")
RELEASE_ADDS = ("checksum", "cell_type")  # what nbgrader's generate_assignment adds to every nbgrader cell
HIDDEN_TESTS = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")


@functools.cache
def nbgrader_helpers():
    """nbgrader's cell helpers (its module `nbgrader/utils.py`), loaded when a notebook is compared: a
    learner's kernel (Colab's, say) imports this module for `check()` without nbgrader installed. Loaded
    from its file, unless nbgrader is imported already: `import nbgrader` first loads the package's
    Jupyter server extensions, 0.5 to 1.6 s of every grading process, for helpers that need none of it."""
    if "nbgrader.utils" in sys.modules:
        return sys.modules["nbgrader.utils"]
    package = importlib.util.find_spec("nbgrader")
    if package is None or package.origin is None:
        raise ModuleNotFoundError("nbgrader is not installed", name="nbgrader")
    spec = importlib.util.spec_from_file_location("autograde._nbgrader_utils",
                                                  Path(package.origin).with_name("utils.py"))
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    return utils


@functools.cache
def released_notebook(exercise: Exercise) -> NotebookNode:
    """The learner notebook of `exercise` as released (shared between calls: do not modify it)."""
    import nbformat

    return nbformat.read(course.exercises() / exercise.notebook, as_version=4)


def findings(submitted: NotebookNode, released: NotebookNode) -> list[str]:
    """How `submitted` departs from `released` in its nbgrader cells, one sentence each, for the
    instructor and the learner; empty when it does not. Never raises."""
    try:
        found = _findings(submitted, released)
    except Exception as exc:  # a last resort: the checks below expect anything, but must not fail the grade
        found = [f"the notebook's nbgrader cells could not be checked ({type(exc).__name__})"]
    return _bounded(found)


@dataclass
class _Cell:
    """A submitted cell as far as it could be read."""
    number: int  # its position, from 1
    cell_type: object
    source: object
    cell_id: str | None
    nbgrader: dict | None  # its nbgrader metadata when that is a dict
    unreadable: str | None  # why its metadata or nbgrader metadata could not be read

    @property
    def grade_id(self) -> str | None:
        grade_id = (self.nbgrader or {}).get("grade_id")
        return grade_id if isinstance(grade_id, str) else None


def _read(number: int, cell) -> _Cell:
    if not isinstance(cell, dict):
        return _Cell(number, None, None, None, None, f"is {_describe(cell)}, not a notebook cell")
    cell_id, source = cell.get("id"), cell.get("source")
    if isinstance(source, list) and all(isinstance(line, str) for line in source):
        source = "".join(source)  # as nbformat stores it on disk
    read = _Cell(number, cell.get("cell_type"), source,
                 cell_id if isinstance(cell_id, str) else None, None, None)
    metadata = cell.get("metadata", {})
    if not isinstance(metadata, dict):
        read.unreadable = f"has metadata that is not a dict ({_describe(metadata)})"
    elif isinstance(metadata.get("nbgrader", {}), dict):
        read.nbgrader = metadata.get("nbgrader")
    else:
        read.unreadable = f"has nbgrader metadata that is not a dict ({_describe(metadata['nbgrader'])})"
    return read


def _findings(submitted: NotebookNode, released: NotebookNode) -> list[str]:
    cells = submitted.get("cells") if isinstance(submitted, dict) else None
    if not isinstance(cells, list):
        return ["the submission has no list of cells, so none of the release's nbgrader cells"]
    ours = [_read(number, cell) for number, cell in enumerate(cells, 1)]
    theirs = {cell.metadata.nbgrader.grade_id: cell for cell in released.cells if "nbgrader" in cell.metadata}
    by_cell_id = {cell.get("id"): grade_id for grade_id, cell in theirs.items() if isinstance(cell.get("id"), str)}

    sharing: dict[str, list[_Cell]] = defaultdict(list)
    for cell in ours:
        if cell.grade_id is not None:
            sharing[cell.grade_id].append(cell)
    matched = {grade_id: list(sharing.get(grade_id, [])) for grade_id in theirs}
    strays = []
    for cell in ours:
        if cell.grade_id in theirs:
            continue
        # A cell whose grade_id was changed or lost is still the release's cell with its id.
        grade_id = by_cell_id.get(cell.cell_id)
        if grade_id is not None and not matched[grade_id]:
            matched[grade_id].append(cell)
        else:
            strays.append(cell)

    source_format = _in_source_format(ours, theirs.values())
    found = [SOURCE_FORMAT] if source_format else []
    for grade_id, original in theirs.items():
        if not matched[grade_id]:
            found.append(f"{_kind(original.metadata.nbgrader)} {_code(grade_id)} was deleted")
        for cell in matched[grade_id]:
            found += _compare(cell, original, source_format)
    found += [finding for cell in strays for finding in _stray(cell)]
    found += [f"{_count(len(cells))} cells share grade_id {_code(grade_id)}"
              for grade_id, cells in sharing.items() if len(cells) > 1]
    return found


def _in_source_format(ours: list[_Cell], released) -> bool:
    """Whether no nbgrader cell of the submission has what the release gave every one of its own."""
    graded = [cell.nbgrader for cell in ours if cell.nbgrader]
    return bool(graded) and all("checksum" in cell.metadata.nbgrader for cell in released) and not any(
        key in nbgrader for nbgrader in graded for key in RELEASE_ADDS)


def _without_hidden_tests(source):
    """The source as nbgrader's release makes it: the hidden tests' lines and their markers removed."""
    if not isinstance(source, str):
        return source
    kept, hidden = [], False
    for line in source.split("\n"):
        if HIDDEN_TESTS[0] in line:
            hidden = True
        elif HIDDEN_TESTS[1] in line:
            hidden = False
        elif not hidden:
            kept.append(line)
    return "\n".join(kept)


def _compare(cell: _Cell, original: NotebookNode, source_format: bool = False) -> list[str]:
    """What changed in the release's nbgrader cell `original`, submitted as `cell` (in nbgrader's
    source format: without what the release adds)."""
    theirs = original.metadata.nbgrader
    name = f"{_kind(theirs)} {_code(theirs.grade_id)}"
    found, forged = [], False
    if cell.unreadable:
        found.append(f"{name} {cell.unreadable}")
    elif cell.nbgrader is None:
        found.append(f"{name} has lost its nbgrader metadata")
    else:
        ours = cell.nbgrader
        fields = [field for field in ("grade_id", *FIELDS) if not (source_format and field in RELEASE_ADDS)]
        changes = [f"{field} {_describe(theirs.get(field, ABSENT))} -> {_describe(ours.get(field, ABSENT))}"
                   for field in fields if not _same(theirs.get(field, ABSENT), ours.get(field, ABSENT))]
        stored = ours.get("checksum", ABSENT)
        if not source_format and not _same(theirs.checksum, stored):
            computed = _checksum(cell)
            forged = computed is not None and stored == computed
            if not forged:
                changes.append(f"checksum {_describe(theirs.checksum)} -> {_describe(stored)}")
        detail = f" ({'; '.join(changes)})" if changes else ""
        if _kind(ours) != _kind(theirs):
            found.append(f"{name} was turned into {_article(_kind(ours))}{detail}")
        elif changes:
            found.append(f"{name} has its nbgrader metadata changed{detail}")
    if cell.cell_type != original.cell_type:
        now = cell.cell_type if cell.cell_type in CELL_TYPES else _describe(cell.cell_type)
        found.append(f"{name} was changed from {_article(original.cell_type)} cell to {_article(now)} cell")
    source = _without_hidden_tests(cell.source) if source_format else cell.source
    if nbgrader_helpers().is_locked(original) and source != original.source:
        found.append(f"{name} was changed{_first_difference(source, original.source)}")
    if forged:  # which `nbgrader validate` would take at its word
        found.append(f"{name} has its stored nbgrader checksum rewritten to match its changes")
    return found


def _stray(cell: _Cell) -> list[str]:
    """A submitted cell that is none of the release's nbgrader cells: fine unless it claims to be one."""
    name = f"cell {cell.number}"
    if cell.unreadable:
        return [f"{name} {cell.unreadable}"]
    if not cell.nbgrader:
        return []
    grade_id = cell.nbgrader.get("grade_id", ABSENT)
    if grade_id is ABSENT:
        return [f"{name} has nbgrader metadata without a grade_id"]
    if cell.grade_id is None:
        return [f"{name} has an nbgrader grade_id that is not text ({_describe(grade_id)})"]
    return [f"cell {_code(grade_id)} has an nbgrader grade_id that the release does not have"]


def _roles(nbgrader: dict) -> NotebookNode:
    """A cell with `nbgrader`'s flags as nbgrader reads them (truthiness), for its helpers."""
    from nbformat.notebooknode import NotebookNode

    flags = {flag: bool(nbgrader.get(flag, False)) for flag in FLAGS}
    return NotebookNode(metadata=NotebookNode(nbgrader=NotebookNode(flags)))


def _kind(nbgrader: dict) -> str:
    cell = _roles(nbgrader)
    if nbgrader_helpers().is_solution(cell):
        return "graded answer cell" if nbgrader_helpers().is_grade(cell) else "solution cell"
    if nbgrader_helpers().is_grade(cell):
        return "test cell"
    if nbgrader_helpers().is_task(cell):
        return "task cell"
    return "locked cell" if nbgrader_helpers().is_locked(cell) else "ordinary cell"


def _checksum(cell: _Cell) -> str | None:
    """nbgrader's checksum of the submitted cell as it stands, or None where nbgrader could not compute one."""
    ours = cell.nbgrader
    if not (isinstance(cell.source, str) and isinstance(cell.cell_type, str) and cell.grade_id):
        return None
    view = _roles(ours)
    view.update(source=cell.source, cell_type=cell.cell_type)
    view.metadata.nbgrader.grade_id = cell.grade_id
    if nbgrader_helpers().is_grade(view):
        points = ours.get("points")
        if isinstance(points, bool) or not isinstance(points, (int, float)) or abs(points) > 1e300:
            return None
        view.metadata.nbgrader.points = float(points)
    try:
        return nbgrader_helpers().compute_checksum(view)
    except UnicodeEncodeError:  # lone surrogates, which JSON allows and UTF-8 does not
        return None


def _same(theirs, ours) -> bool:
    """Equal as JSON values: 2 and 2.0 alike, True and 1 not (the release's values are scalars)."""
    if isinstance(theirs, bool) or isinstance(ours, bool) or not (
            isinstance(theirs, (int, float)) and isinstance(ours, (int, float))):
        return type(theirs) is type(ours) and theirs == ours
    return theirs == ours  # exact between int and float, even for huge ints


def _describe(value) -> str:
    """A JSON value in a few words, whatever its size."""
    if value is ABSENT:
        return "absent"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value.bit_length() <= 64:
            return str(value)
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"  # str() refuses 4300 digits
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    if isinstance(value, str):
        return f'"{_escaped(value)}"'
    if isinstance(value, list):
        return f"a list of {_plural(len(value), 'item')}"
    if isinstance(value, dict):
        return f"a dict of {_plural(len(value), 'key')}"
    return f"a {type(value).__name__}"


def _escaped(text: str, limit: int = 40) -> str:
    """`text` cut to `limit` characters, printable ASCII only, no backticks (findings go into Markdown)."""
    shown = json.dumps(text[:limit], ensure_ascii=True)[1:-1].replace("`", "'")
    return shown + ("…" if len(text) > limit else "")


def _code(grade_id: str) -> str:
    return f"`{_escaped(grade_id)}`"


def _article(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _plural(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _count(number: int) -> str:
    return {2: "two", 3: "three"}.get(number, str(number))


def _first_difference(source, original: str) -> str:
    if not isinstance(source, str):
        return f" (its source is {_describe(source)})"
    ours, theirs = source.splitlines(), original.splitlines()
    if ours == theirs:
        return " (in its line endings)"
    line = next((n for n, (a, b) in enumerate(zip(ours, theirs), 1) if a != b), min(len(ours), len(theirs)) + 1)
    return f" (from line {line})"


def _bounded(found: list[str]) -> list[str]:
    """Each finding once, cut to MAX_CHARS, and at most MAX_FINDINGS of them."""
    unique = [text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 1] + "…" for text in dict.fromkeys(found)]
    if len(unique) <= MAX_FINDINGS:
        return unique
    return unique[:MAX_FINDINGS] + [f"and {len(unique) - MAX_FINDINGS} more"]
