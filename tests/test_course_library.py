"""The course's library (book/attention_lib.py): each mechanism defined once, in its chapter.

tools/course_library.py writes the module from the chapters' cells tagged `library` at every
build; these tests hold the committed copy to the chapters, keep the chapters from writing a
second copy of a library definition, and check that what the chapters import behaves as the
course teaches (no NaN in either pass for a query that may attend nothing).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from book_site import colab_notebook, library_setup_source  # noqa: E402
from course_library import MODULE, NAME, TAG, chapters, importing_chapters, library_source, python_sources  # noqa: E402


def load_library():
    spec = importlib.util.spec_from_file_location(NAME, ROOT / MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def library_names() -> set[str]:
    tree = ast.parse((ROOT / MODULE).read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def chapter_cells() -> dict[str, list[tuple[str, list[str]]]]:
    return {page: python_sources(ROOT / f"{page}.md") for page in chapters(ROOT)}


def test_the_committed_library_is_what_the_chapters_define():
    assert (ROOT / MODULE).read_text(encoding="utf-8") == library_source(ROOT), \
        f"{MODULE} is stale: build the book (`make book`) and commit it"


def test_no_chapter_writes_a_second_copy_of_a_library_definition():
    """A later chapter imports `attention`; it does not define its own, which could drift. The
    chapter that teaches a definition may build it up in steps before its library cell."""
    definers: dict[str, set[str]] = {}
    owners: dict[str, str] = {}
    for page, cells in chapter_cells().items():
        for source, tags in cells:
            for node in ast.parse(source).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    definers.setdefault(node.name, set()).add(page)
                    if TAG in tags:
                        owners[node.name] = page
    assert set(owners) == library_names()
    copies = {name: sorted(definers[name] - {page}) for name, page in owners.items() if definers[name] - {page}}
    assert not copies, f"defined again outside the chapter that teaches them (import them instead): {copies}"


def test_chapters_import_only_what_the_library_defines_and_what_earlier_chapters_taught():
    names, owner = library_names(), {}
    importers = set()
    for position, (page, cells) in enumerate(chapter_cells().items()):
        for source, tags in cells:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and node.module == NAME:
                    importers.add(page)
                    for alias in node.names:
                        assert alias.name in names, f"{page} imports {alias.name}, which no {TAG!r} cell defines"
                        assert owner[alias.name][0] < position, \
                            f"{page} imports {alias.name} before {owner[alias.name][1]} defines it"
            if TAG in tags:
                for node in ast.parse(source).body:
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                        owner[node.name] = (position, page)
    # The chapters that used to define attention of their own now share chapter 1's.
    assert {"book/worked-example", "book/multi-head-attention", "book/positions",
            "book/pytorch-multiheadattention", "book/tiled-forward", "book/flash-backward",
            "book/triton-kernel", "book/split-kv", "book/linear-attention"} <= importers
    # The build re-runs exactly these when the library changes (tools/course_library.py).
    assert set(importing_chapters(ROOT)) == importers


def test_attention_is_nan_free_in_both_passes_and_agrees_with_pytorch():
    library = load_library()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = library.causal_mask(5, 3)  # L > S: the first two queries may attend nothing
    out, weights = library.attention(q, k[:, :3], v[:, :3], mask)
    out.sum().backward()
    assert not out[:, :2].any() and not weights[:, :2].any()  # output 0 and weights 0
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(tensor.grad).all(), f"NaN or inf in the gradient of {name}"
    expected = torch.nn.functional.scaled_dot_product_attention(q, k[:, :3], v[:, :3], attn_mask=mask)
    assert (out - expected).abs().max().item() < 1e-12


@pytest.mark.parametrize("L, S", [(7, 7), (4, 9), (9, 4)])
def test_naive_attention_gives_the_logsumexp_and_no_nan_gradient(L, S):
    library = load_library()
    generator = torch.Generator().manual_seed(L * S)
    q = torch.randn(1, 2, L, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 16, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = library.naive_attention(q, k, v, causal=True)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(16)).masked_fill(~library.causal_mask(L, S), -math.inf)
    expected_lse = torch.logsumexp(scores, dim=-1)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(expected_lse))
    seen = torch.isfinite(expected_lse)
    assert (lse[seen] - expected_lse[seen]).abs().max().item() < 1e-12
    assert (out - library.attention(q, k, v, library.causal_mask(L, S))[0]).abs().max().item() < 1e-12
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_a_library_cell_that_needs_an_undefined_name_stops_the_build(tmp_path):
    (tmp_path / "book").mkdir()
    (tmp_path / "_toc.yml").write_text(yaml.safe_dump({"format": "jb-book", "root": "book/one"}))
    (tmp_path / "book" / "one.md").write_text(
        "---\nkernelspec:\n  name: python3\n  display_name: Python 3\n---\n\n# One\n\n"
        "```{code-cell} ipython3\nimport math\nSCALE = 2.0\n```\n\n"
        "```{code-cell} ipython3\n:tags: [library]\ndef scaled(x):\n    return math.sqrt(x) * SCALE\n```\n")
    with pytest.raises(ValueError, match="SCALE"):
        library_source(tmp_path)


def test_a_colab_notebook_fetches_the_library_its_chapter_imports():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["repository"]
    owner_and_name = config["url"].removeprefix("https://github.com/")
    url = f"https://raw.githubusercontent.com/{owner_and_name}/{config['branch']}/{MODULE}"
    setup = library_setup_source()
    assert url in setup
    first_sources = {}
    for chapter in ("worked-example", "attention-as-soft-lookup"):
        notebook = json.loads(colab_notebook((ROOT / "book" / f"{chapter}.md").read_text(encoding="utf-8")))
        first_sources[chapter] = ["".join(cell["source"]) for cell in notebook["cells"][:2]]
    assert setup in first_sources["worked-example"]  # imports attention from the library
    assert setup not in first_sources["attention-as-soft-lookup"]  # defines it
