"""No code a learner can read in the class edition is a near-copy of a graded answer (tools/near_copies.py).

The sources' check runs without a build: the class edition shows exactly the cells not tagged
graded-answer (and the fenced code of the pages without a notebook), which are also what the
open edition shows besides its answers. The site's check reads the built class edition's pages.
"""
from __future__ import annotations

import ast
import html
import sys
from pathlib import Path

import jupytext
import pytest

from tests.test_class_edition import (
    CHAPTER_ANSWERS,
    CLASS_HTML,
    class_build,  # noqa: F401  (the fixture that builds the class site)
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import near_copies  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Near-copies shown on purpose, by (reference, chapter): each is a source document's own code, which
# the chapter runs to demonstrate its erratum and which the learner can read in the source anyway.
DELIBERATE = {
    ("MSA_fixed", "pytorch-multiheadattention"):
        "Source 003's MSA, right only because two names are swapped; MSA_fixed swaps them back",
}


def deliberate(copy: near_copies.NearCopy) -> bool:
    name = copy.reference.rsplit(": ", 1)[1].split(".")[0]
    return any(name == reference and copy.candidate.startswith(f"book/{chapter}.") for reference, chapter in DELIBERATE)


@pytest.fixture(scope="module")
def answers() -> list[near_copies.Unit]:
    units = near_copies.answers(CHAPTER_ANSWERS)
    # Every exercise's solution and every chapter that hides an answer must give references.
    assert {unit.where.split(" ")[0] for unit in units if unit.where.startswith("solutions/")} >= {
        str(path.relative_to(ROOT)) for path in (ROOT / "solutions").rglob("*.ipynb")}
    assert {unit.where.split(" ")[0] for unit in units if unit.where.startswith("book/")} >= {
        f"book/{chapter}.md" for chapter in ("rope-kv-cache", "mla", "paged-kv-cache", "split-kv", "positions")}
    return units


class Renamer(ast.NodeTransformer):
    """Every name, argument, own attribute and number changed: the disguise a copy would wear."""

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id=f"renamed_{node.id}", ctx=node.ctx), node)

    def visit_arg(self, node):
        node.arg = f"renamed_{node.arg}"
        return node

    def visit_FunctionDef(self, node):
        node.name = f"renamed_{node.name}"
        return self.generic_visit(node)

    def visit_Attribute(self, node):
        if node.attr not in near_copies._api_names():
            node.attr = f"renamed_{node.attr}"
        return self.generic_visit(node)

    def visit_Constant(self, node):
        return ast.copy_location(ast.Constant(node.value + 1), node) if type(node.value) is int else node


def disguised_solution(name: str) -> str:
    """The solutions' definition of `name`, every identifier and integer changed."""
    for notebook in sorted((ROOT / "solutions").rglob("*.ipynb")):
        for cell in jupytext.read(notebook).cells:
            tree = ast.parse(cell.source) if cell.cell_type == "code" and f"def {name}(" in cell.source else None
            for node in tree.body if tree else []:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return ast.unparse(ast.fix_missing_locations(Renamer().visit(node)))
    raise LookupError(name)


def unexpected(found: list[near_copies.NearCopy]) -> list[str]:
    return [f"{copy.candidate} is {copy.coverage:.0%} of {copy.reference}" for copy in found if not deliberate(copy)]


def test_no_code_the_class_edition_shows_is_a_near_copy_of_an_answer(answers):
    """On the sources: the untagged cells of every chapter, the fenced code of the other pages."""
    shown = near_copies.shown_in_sources()
    assert len(shown) > 300, "the book's shown code was not found"
    found = near_copies.near_copies(answers, shown)
    assert not unexpected(found)
    # Each deliberate exception is still there, and still the only near-copy of its reference.
    assert {(copy.reference.rsplit(": ", 1)[1], Path(copy.candidate.split(" ")[0]).stem) for copy in found} \
        == set(DELIBERATE)


@pytest.mark.parametrize("name", ["rope_decode_step", "paged_attention", "flash_attention_backward"])
def test_a_planted_near_copy_is_caught_in_the_sources(tmp_path, answers, name):
    planted = disguised_solution(name)
    assert f"def {name}(" not in planted
    (tmp_path / "book").mkdir()
    chapter = (ROOT / "book" / "paged-kv-cache.md").read_text(encoding="utf-8")
    (tmp_path / "book" / "paged-kv-cache.md").write_text(
        chapter + f"\n```{{code-cell}} ipython3\n{planted}\n```\n", encoding="utf-8")
    found = near_copies.near_copies(answers, near_copies.shown_in_sources(tmp_path))
    caught = [copy for copy in found if copy.reference.endswith(f": {name}")]
    assert caught and all(copy.candidate.startswith("book/paged-kv-cache.md") for copy in caught)
    assert max(copy.coverage for copy in caught) == 1.0
    # Without the plant the same chapter holds no near-copy of it.
    (tmp_path / "book" / "paged-kv-cache.md").write_text(chapter, encoding="utf-8")
    assert not unexpected(near_copies.near_copies(answers, near_copies.shown_in_sources(tmp_path)))


def test_a_planted_near_copy_is_caught_in_a_page(tmp_path, answers):
    """As a site shows code: highlighted, in spans, escaped, inside <pre>."""
    planted = disguised_solution("rope_decode_step")
    marked_up = "".join(f'<span class="n">{html.escape(line)}</span>\n' for line in planted.splitlines())
    (tmp_path / "page.html").write_text(f"<html><body><div class=\"highlight\"><pre>{marked_up}</pre></div>"
                                        "<pre>printed output, not Python: 1.0e-16</pre></body></html>",
                                        encoding="utf-8")
    found = near_copies.near_copies(answers, near_copies.shown_in_site(tmp_path))
    assert any(copy.reference.endswith(": rope_decode_step") and copy.candidate.startswith("page.html")
               for copy in found)


@pytest.mark.book
def test_the_class_site_holds_no_near_copy_of_an_answer(class_build, answers):  # noqa: F811
    shown = near_copies.shown_in_site(CLASS_HTML)
    assert len(shown) > 300, "the class site's code was not found"
    assert not unexpected(near_copies.near_copies(answers, shown))
