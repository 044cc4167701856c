"""The class edition (`make book EDITION=class`): the book without any graded answer.

The site is built by `make book EDITION=class` unless a build newer than every input of the
book (book/, _config.yml, _toc.yml, references.bib, tools/) is already there: make touches
`_build/class/built` only after a successful build, so that stamp's time decides.
"""
from __future__ import annotations

import ast
import hashlib
import html
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

from autograde import registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from book_site import colab_notebook  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLASS_BUILD = ROOT / "_build" / "class"
# jupyter-book writes into <--path-output>/_build.
CLASS_HTML = CLASS_BUILD / "_build" / "html"
BUILT = CLASS_BUILD / "built"
OPEN_HTML = ROOT / "_build" / "html"
BOOK_INPUTS = [ROOT / "book", ROOT / "_config.yml", ROOT / "_toc.yml", ROOT / "references.bib", ROOT / "tools"]
TAG = "graded-answer"

REQUIRED = sorted({name for exercise in registry.EXERCISES.values() for name in exercise.required})
# The chapters' own versions of the graded mechanisms, under names of their own (the contract's
# names are in REQUIRED), and the chapters' code one step away from one (a mistake that differs from
# the graded step by a line, a gather that any attention turns into paged attention). Each is
# defined only in cells tagged graded-answer.
CHAPTER_ANSWERS = {
    "attention-as-soft-lookup": ["attention"],
    "multi-head-attention": ["mha_per_head", "mha_packed", "mha_with"],
    "worked-example": ["multi_head_attention"],
    "pytorch-multiheadattention": ["input_projections", "multihead_attention_from", "MSA_fixed"],
    "positions": ["rotate", "rope_tables", "rotate_half", "rotate_with_tables", "rotary_attention_layer",
                  "shifted_layer"],
    "mqa-gqa": ["multi_query_attention", "FixedGroupQueryAttention", "repeat_kv_expand"],
    "kv-cache": ["decode_step", "decode_step_preallocated"],
    "rope-kv-cache": ["rotate", "decode_step", "decode_step_rotating_again", "decode_step_rotate_on_read"],
    "mla": ["rotate", "new_token_projections", "attend_explicit", "mla_step", "cache_numbers_per_token",
            "attend_absorbed", "mla_step_merged"],
    "online-softmax": ["online_softmax_blocks", "online_softmax_masked"],
    "memory-bound": ["naive_attention", "tiled_attention"],
    "tiled-forward": ["flash_attention_forward_kv_outer"],
    "flash-backward": ["AttentionSavingP"],
    "triton-kernel": ["flash_forward_kernel", "flash_forward_two_phase"],
    "split-kv": ["chunk_state", "merge_states", "decode_split", "merge_all"],
    "paged-kv-cache": ["paged_append", "contiguous_view", "read_paged", "contiguous_attention",
                       "read_paged_streaming"],
    "decode-kernel": ["decode_partial_kernel", "decode_merge_kernel", "flash_decode", "reference_decode",
                      "paged_partial_kernel"],
    "attention-variants": ["full_attention"],
    "visualising-attention": ["SelfAttention"],
}
ANSWER_NAMES = sorted(set(REQUIRED).union(*CHAPTER_ANSWERS.values()))


def chapter_cells(chapter: str) -> list:
    notebook = jupytext.read(ROOT / "book" / f"{chapter}.md", fmt="md:myst")
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def is_tagged(cell) -> bool:
    return TAG in cell.metadata.get("tags", [])


def top_level_definitions(source: str) -> set[str]:
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    return {node.name for node in ast.parse(code).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


CHAPTERS = sorted(path.stem for path in (ROOT / "book").glob("*.md") if "```{code-cell}" in path.read_text())
DEFINITION = re.compile(r"^(?P<indent>[ \t]*)(?:def|class)[ \t]+(?P<name>\w+)[ \t]*[(:]", re.MULTILINE)
LOOSE_DEFINITION = re.compile(r"\b(?:def|class)\s+(?P<name>\w+)\s*[(:]")
PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.DOTALL | re.IGNORECASE)


def text_of(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def definitions_in_text(text: str) -> set[str]:
    """Names that `def name(` or `class name(` defines: the header is followed by an indented line.

    The contract page states `class MultiHeadAttention(nn.Module): __init__(...)` in prose, with
    no indented body under it: a signature, not a definition."""
    found = set()
    for match in DEFINITION.finditer(text):
        rest = text[match.end():].split("\n")[1:]
        following = next((line for line in rest if line.strip()), "")
        if len(following) - len(following.lstrip()) > len(match["indent"]):
            found.add(match["name"])
    return found


def definitions_in_file(path: Path) -> set[str]:
    text = path.read_bytes().decode("utf-8", errors="ignore")
    if path.suffix != ".html":
        return {match["name"] for match in LOOSE_DEFINITION.finditer(text)}
    # Inside a code block (<pre>) any header counts, one-line definitions included.
    in_code = {match["name"] for block in PRE.findall(text) for match in LOOSE_DEFINITION.finditer(text_of(block))}
    return in_code | definitions_in_text(text_of(text))


def figures(page: Path) -> int:
    return len(re.findall(r"<img\b[^>]*\bsrc=\"[^\"]*_images/", page.read_text(encoding="utf-8")))


def newest_input() -> float:
    files = [path for root in BOOK_INPUTS for path in ([root] if root.is_file() else root.rglob("*"))
             if path.is_file() and "__pycache__" not in path.parts]
    return max(path.stat().st_mtime for path in files)


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {path.name: (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
            for path in sorted(folder.glob("*"))}


@pytest.fixture(scope="module")
def class_build() -> dict:
    """The class site; built here (a cold build executes every chapter: minutes) when stale."""
    if BUILT.exists() and BUILT.stat().st_mtime >= newest_input() and CLASS_HTML.is_dir():
        return {"built_here": False}
    before = snapshot(ROOT / "notebooks")
    subprocess.run(["make", "book", "EDITION=class"], cwd=ROOT, check=True)
    return {"built_here": True, "notebooks_before": before, "notebooks_after": snapshot(ROOT / "notebooks")}


def test_answer_names_are_defined_only_in_tagged_cells():
    """The list above names what the tags hide: no untagged cell defines one of its names."""
    untagged = set().union(*(top_level_definitions(cell.source) for chapter in CHAPTERS
                             for cell in chapter_cells(chapter) if not is_tagged(cell)))
    for chapter, names in CHAPTER_ANSWERS.items():
        tagged = set().union(*(top_level_definitions(cell.source)
                               for cell in chapter_cells(chapter) if is_tagged(cell)))
        assert set(names) <= tagged, f"{chapter}: untagged {sorted(set(names) - tagged)}"
    assert not untagged & set(ANSWER_NAMES), f"defined in untagged cells: {sorted(untagged & set(ANSWER_NAMES))}"


@pytest.mark.book
def test_no_file_of_the_class_edition_defines_a_graded_answer(class_build):
    files = [path for path in CLASS_HTML.rglob("*") if path.is_file()]
    assert any(path.name == "searchindex.js" for path in files)
    leaks = {str(path.relative_to(CLASS_HTML)): sorted(definitions_in_file(path) & set(ANSWER_NAMES))
             for path in files}
    assert not {path: names for path, names in leaks.items() if names}


@pytest.mark.book
def test_every_tagged_cell_is_replaced_by_a_note(class_build):
    for chapter in CHAPTERS:
        tagged = sum(map(is_tagged, chapter_cells(chapter)))
        page = (CLASS_HTML / "book" / f"{chapter}.html").read_text(encoding="utf-8")
        assert page.count("graded-answer-left-out") == tagged, chapter


@pytest.mark.book
def test_class_edition_keeps_the_figures(class_build):
    if not OPEN_HTML.is_dir():
        pytest.skip("no open edition in _build/html to compare with: run `make book`")
    for chapter in CHAPTERS:
        open_figures = figures(OPEN_HTML / "book" / f"{chapter}.html")
        assert figures(CLASS_HTML / "book" / f"{chapter}.html") == open_figures, chapter


@pytest.mark.book
def test_class_edition_has_no_sources_downloads_or_launch_buttons(class_build):
    assert not [path for path in CLASS_HTML.rglob("_sources")], "a _sources folder"
    assert not list(CLASS_HTML.rglob("*.ipynb")) and not list(CLASS_HTML.rglob("*.md"))
    for chapter in CHAPTERS:
        page = (CLASS_HTML / "book" / f"{chapter}.html").read_text(encoding="utf-8")
        for marker in ("colab.research.google.com", "mybinder.org", "btn-download", "launch-buttons"):
            assert marker not in page, f"{chapter}: {marker}"


@pytest.mark.book
def test_class_build_leaves_the_colab_notebooks_alone(class_build):
    """Colab opens the open edition's notebooks, answers in, whichever edition was built last."""
    if class_build["built_here"]:
        assert class_build["notebooks_after"] == class_build["notebooks_before"]
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        chapter = (ROOT / "book" / f"{notebook.stem}.md").read_text(encoding="utf-8")
        assert notebook.read_text(encoding="utf-8") == colab_notebook(chapter), f"{notebook.name} was rewritten"


def test_open_edition_still_shows_the_answers():
    assert OPEN_HTML.is_dir(), "run `make book` first"
    shown = set().union(*(definitions_in_file(OPEN_HTML / "book" / f"{chapter}.html") for chapter in CHAPTERS))
    in_chapters = set().union(*(top_level_definitions(cell.source) for chapter in CHAPTERS
                                for cell in chapter_cells(chapter) if is_tagged(cell)))
    expected = set(ANSWER_NAMES) & in_chapters
    assert expected >= set(CHAPTER_ANSWERS["mqa-gqa"]) | {"causal_mask", "split_heads", "flash_attention_forward"}
    assert expected <= shown, f"missing from the open edition: {sorted(expected - shown)}"
    assert (OPEN_HTML / "_sources").is_dir()
    assert "colab.research.google.com" in (OPEN_HTML / "book" / "kv-cache.html").read_text(encoding="utf-8")
