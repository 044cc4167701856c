"""Near-copies of graded answers in code a learner can read.

The class edition hides the cells tagged ``graded-answer`` (tools/class_edition.py), but an
untagged cell can still hold an answer under other names: a "mistake" one line away from the
graded step, a demonstration that spells out a graded forward pass. This module finds them.

References, the answers: the functions and methods that define the graded names, the
contract's (as ``autograde.registry`` lists them) in ``solutions/`` and in the chapters' cells
tagged ``graded-answer``, and the chapters' own versions of them, under names of their own, in
those cells. Constructors are left out: the contract prescribes their layers, so every
module's ``__init__`` looks alike. Candidates, what a learner reads: each function and method of
the shown code, and each shown block as a whole (a demonstration need not be a function).

Each unit of code becomes a sequence of tokens from its AST: node types in order, with every
name, argument and literal replaced by a placeholder, and attribute names kept only when they
are PyTorch's or ``math``'s (``.transpose``, ``.softmax``): renaming variables, functions or
one's own attributes changes nothing. A candidate is a near-copy of a reference when runs of
at least ``MIN_RUN`` tokens, matched in order, cover at least ``THRESHOLD`` of the reference's
tokens. References shorter than ``MIN_TOKENS`` tokens (one-line helpers) are not compared:
their shape is any short function's.
"""
from __future__ import annotations

import ast
import difflib
import html
import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jupytext

TAG = "graded-answer"
THRESHOLD = 0.7
MIN_RUN = 6
MIN_TOKENS = 60
ROOT = Path(__file__).resolve().parents[1]
_PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^```(?:python|python3|ipython3|py)\s*\n(.*?)^```", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Unit:
    where: str  # a label for people: file, cell or block, and the function's name
    tokens: tuple[str, ...]


@dataclass(frozen=True)
class NearCopy:
    reference: str
    candidate: str
    coverage: float


@lru_cache(maxsize=None)
def _api_names() -> frozenset[str]:
    """Attribute names that are PyTorch's or math's: kept, since a renamed copy keeps them too."""
    import torch
    import torch.nn.functional as F

    return frozenset(name for namespace in (torch, torch.Tensor, torch.nn, F, math) for name in dir(namespace)
                     if not name.startswith("_"))


def tokens(node: ast.AST) -> tuple[str, ...]:
    """The node's subtree as node types in order, names and literals replaced by placeholders."""
    out = []
    for child in _preorder(node):
        kind = type(child).__name__
        if isinstance(child, ast.Attribute):
            out.append(f"Attribute.{child.attr}" if child.attr in _api_names() else "Attribute")
        elif isinstance(child, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.AugAssign)):
            operators = child.ops if isinstance(child, ast.Compare) else [child.op]
            out.append(kind + "." + ".".join(type(op).__name__ for op in operators))
        elif not isinstance(child, (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)):
            out.append(kind)
    return tuple(out)


def _preorder(node: ast.AST):
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _preorder(child)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in _preorder(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _parse(source: str) -> ast.Module | None:
    """Python without its magics and shell lines, or None where it is not Python (a printed output)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def candidate_units(where: str, source: str) -> list[Unit]:
    """What a learner reads in one block of code: the block, and each function in it."""
    tree = _parse(source)
    if tree is None or not tree.body:
        return []
    body = tuple(token for statement in tree.body for token in tokens(statement))
    return [Unit(where, body)] + [Unit(f"{where}: {function.name}", tokens(function)) for function in _functions(tree)]


def reference_units(where: str, source: str, names: set[str]) -> list[Unit]:
    """The functions and methods (constructors aside) of a block's top-level definitions named in `names`."""
    tree = _parse(source)
    if tree is None:
        return []
    chosen = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    units = [Unit(f"{where}: {node.name}" + (f".{function.name}" if function is not node else ""), tokens(function))
             for node in chosen for function in _functions(node) if function.name != "__init__"]
    return [unit for unit in units if len(unit.tokens) >= MIN_TOKENS]


def _runs(sequence: tuple[str, ...]) -> set[tuple[str, ...]]:
    return {sequence[i:i + MIN_RUN] for i in range(len(sequence) - MIN_RUN + 1)}


def _coverage_bound(reference: tuple[str, ...], candidate_runs: set[tuple[str, ...]]) -> float:
    """At least coverage(): the share of the reference inside some run of MIN_RUN tokens the candidate has."""
    covered, reach = 0, 0
    for start in range(len(reference) - MIN_RUN + 1):
        if reference[start:start + MIN_RUN] in candidate_runs:
            covered += start + MIN_RUN - max(start, reach)
            reach = start + MIN_RUN
    return covered / len(reference)


def coverage(reference: tuple[str, ...], candidate: tuple[str, ...]) -> float:
    """The share of the reference's tokens that runs of at least MIN_RUN tokens of the candidate match, in order."""
    matcher = difflib.SequenceMatcher(None, reference, candidate, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks() if block.size >= MIN_RUN)
    return matched / len(reference)


def near_copies(references: list[Unit], candidates: list[Unit], threshold: float = THRESHOLD) -> list[NearCopy]:
    found = []
    runs = {candidate.tokens: _runs(candidate.tokens) for candidate in candidates}
    for reference in references:
        for candidate in candidates:
            # A cheap bound first: most pairs share too few runs to be worth aligning.
            if (len(candidate.tokens) < threshold * len(reference.tokens)
                    or _coverage_bound(reference.tokens, runs[candidate.tokens]) < threshold):
                continue
            share = coverage(reference.tokens, candidate.tokens)
            if share >= threshold:
                found.append(NearCopy(reference.where, candidate.where, share))
    return found


# Where the code is.

def chapter_cells(chapter: Path) -> list[tuple[str, bool]]:
    """(source, tagged graded-answer) of each code cell of a chapter notebook."""
    notebook = jupytext.read(chapter, fmt="md:myst")
    return [(cell.source, TAG in cell.metadata.get("tags", [])) for cell in notebook.cells if cell.cell_type == "code"]


def _is_notebook(page: Path) -> bool:
    return "```{code-cell}" in page.read_text(encoding="utf-8")


def graded_names() -> set[str]:
    from autograde import registry

    return {name for exercise in registry.EXERCISES.values() for name in exercise.required}


def answers(chapter_answers: dict[str, list[str]], root: Path = ROOT) -> list[Unit]:
    """The references: the definitions of the graded names in the solutions and the chapters' tagged
    cells, and those of each chapter's own versions (`chapter_answers`, chapter -> names)."""
    names = graded_names()
    units = []
    for notebook in sorted((root / "solutions").rglob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        for number, cell in enumerate(cells, 1):
            if cell["cell_type"] == "code":
                where = f"{notebook.relative_to(root)} cell {number}"
                units += reference_units(where, "".join(cell["source"]), names)
    for chapter in sorted((root / "book").glob("*.md")):
        if _is_notebook(chapter):
            own = names | set(chapter_answers.get(chapter.stem, []))
            for number, (source, tagged) in enumerate(chapter_cells(chapter), 1):
                if tagged:
                    units += reference_units(f"book/{chapter.name} code cell {number}", source, own)
    return units


def shown_in_sources(root: Path = ROOT) -> list[Unit]:
    """The code of the book's sources that the class edition shows: untagged cells and fenced code."""
    units = []
    for page in sorted((root / "book").glob("*.md")):
        where = f"book/{page.name}"
        if _is_notebook(page):
            for number, (source, tagged) in enumerate(chapter_cells(page), 1):
                if not tagged:
                    units += candidate_units(f"{where} code cell {number}", source)
        else:
            for number, match in enumerate(_FENCE.finditer(page.read_text(encoding="utf-8")), 1):
                units += candidate_units(f"{where} code block {number}", match.group(1))
    return units


def shown_in_site(site: Path) -> list[Unit]:
    """The code blocks of a built site's pages (every <pre> that parses as Python)."""
    units = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8", errors="ignore")
        for number, block in enumerate(_PRE.findall(text), 1):
            source = html.unescape(re.sub(r"<[^>]+>", "", block))
            units += candidate_units(f"{page.relative_to(site)} block {number}", source)
    return units
