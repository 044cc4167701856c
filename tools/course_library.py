"""Sphinx extension: the course's library, what a chapter defines once and later chapters import.

A code cell tagged ``library`` holds definitions that later chapters reuse (d2l.ai marks
them ``#@save``). Every top-level function and class of such a cell, in the order of
``_toc.yml``, goes into ``book/attention_lib.py``, with the imports they need taken from the
chapters' cells; a later chapter writes ``from attention_lib import attention`` instead of a
second copy that could drift. The chapter stays the one source: the module is written at the
start of every build, before any chapter runs, and committed, so that a chapter opened in
Colab can fetch it (tools/book_site.py); tests/test_course_library.py checks the committed
copy. A definition that needs a name nothing in the module provides stops the build. When the
library changes, the chapters that import it run again: a cached build never shows outputs
computed with an older library.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import symtable
import sys
from pathlib import Path

import jupytext
import yaml
from jupyter_cache import get_cache
from sphinx.errors import ExtensionError

TAG = "library"
MODULE = "book/attention_lib.py"
NAME = Path(MODULE).stem  # what a chapter imports
ROOT = Path(__file__).resolve().parents[1]
HEADER = '''\
"""The course's library: the definitions of the chapters' cells tagged `library`.

Written by tools/course_library.py at every build of the book, from the chapters named
above each definition: change the chapter, not this file.
"""
'''


def chapters(root: Path) -> list[str]:
    """The book's pages in reading order, as paths relative to `root` without the suffix."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    pages = [toc["root"]]

    def walk(entries):
        for entry in entries:
            if "file" in entry:
                pages.append(entry["file"])
            walk(entry.get("chapters", []) + entry.get("sections", []))

    walk(toc.get("parts", []) + toc.get("chapters", []))
    return pages


def top_level(source: str, kinds: tuple[type, ...]) -> list[tuple[ast.stmt, str]]:
    """The top-level statements of `kinds` in a cell, each with its source (decorators included)."""
    lines = source.splitlines()
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, kinds):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            found.append((node, "\n".join(lines[first - 1:node.end_lineno])))
    return found


def python_sources(chapter: Path) -> list[tuple[str, list[str]]]:
    """(source, tags) of each code cell of a chapter that runs: a cell magic's cell is left out,
    line magics and shell escapes (``%pip``, ``!ls``) become blank lines."""
    notebook = jupytext.read(chapter, fmt="md:myst")
    if "kernelspec" not in notebook.metadata:
        return []  # a page of text: its code blocks are shown, never run
    found = []
    for cell in notebook.cells:
        if cell.cell_type != "code" or cell.source.lstrip().startswith("%%"):
            continue
        lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines()]
        found.append(("\n".join(lines), cell.metadata.get("tags", [])))
    return found


def _needed_names(source: str) -> set[str]:
    """Names the module's code reads from the module's namespace without binding them there."""
    module = symtable.symtable(source, NAME, "exec")
    bound = {s.get_name() for s in module.get_symbols() if s.is_assigned() or s.is_imported()}
    needed, tables = set(), [module]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            reads_module = symbol.is_global() or (table is module and symbol.is_referenced())
            if reads_module and symbol.get_name() not in bound:
                needed.add(symbol.get_name())
    return needed - set(dir(builtins))


def library_source(root: Path = ROOT) -> str:
    """The text of the library module, from the chapters under `root`."""
    imports: dict[str, str] = {}  # a bound name -> the first import statement binding it
    blocks, owner = [], {}
    for page in chapters(root):
        path = root / f"{page}.md"
        if not path.exists():
            continue
        definitions = []
        for source, tags in python_sources(path):
            for node, text in top_level(source, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    imports.setdefault((alias.asname or alias.name).split(".")[0], text)
            if TAG in tags:
                for node, text in top_level(source, (ast.FunctionDef, ast.ClassDef)):
                    if node.name in owner:
                        raise ValueError(f"{node.name} is defined in cells tagged {TAG!r} of both "
                                         f"{owner[node.name]} and {page}.md: a library name has one source")
                    owner[node.name] = f"{page}.md"
                    definitions.append(text)
        if definitions:
            blocks.append(f"# {page}.md\n\n" + "\n\n\n".join(definitions))
    body = "\n\n\n".join(blocks)
    needed = _needed_names(body)
    missing = sorted(name for name in needed if name not in imports)
    if missing:
        raise ValueError(f"the cells tagged {TAG!r} use {', '.join(missing)}, which no chapter imports and no "
                         f"library cell defines: define them in a {TAG!r} cell or leave them out of it")
    sections = [[], []]  # the standard library's imports, then the others', as isort orders them
    for text in sorted({imports[name] for name in needed}, key=lambda text: (text.startswith("from"), text)):
        sections[text.split()[1].split(".")[0] not in sys.stdlib_module_names].append(text)
    return HEADER + "\n" + "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n\n\n" + body + "\n"


def imports_library(source: str) -> bool:
    """Whether a code cell's source imports the library (its line magics are not Python)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    return any(isinstance(node, ast.ImportFrom) and node.module == NAME or
               isinstance(node, ast.Import) and any(alias.name == NAME for alias in node.names)
               for node in ast.walk(ast.parse(code)))


def importing_chapters(root: Path = ROOT) -> list[str]:
    """The pages (as in _toc.yml) whose code imports the library."""
    return [page for page in chapters(root) if (root / f"{page}.md").exists()
            and any(imports_library(source) for source, _ in python_sources(root / f"{page}.md"))]


def _stamp(app) -> Path:
    """Where a build records the library its chapters' outputs were computed with."""
    return Path(app.outdir).parent / f"{NAME}.sha256"


def write_library(app) -> None:
    root = Path(app.srcdir)
    try:
        text = library_source(root)
    except ValueError as error:
        raise ExtensionError(f"{MODULE}: {error}") from None
    target = root / MODULE
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")
    # myst-nb's cache knows a chapter by its own code: a chapter that imports a changed library
    # would keep outputs computed with the old one. Forget them, and read those chapters again.
    app.library_digest = hashlib.sha256(text.encode()).hexdigest()
    stamp = _stamp(app)
    app.library_outdated = []
    if stamp.exists() and stamp.read_text() != app.library_digest:
        app.library_outdated = importing_chapters(root)
        cache_folder = Path(app.outdir).parent / ".jupyter_cache"
        if cache_folder.is_dir():
            cache = get_cache(str(cache_folder))
            stale = {str((root / f"{page}.md").resolve()) for page in app.library_outdated}
            for record in cache.list_cache_records():
                if str(Path(record.uri).resolve()) in stale:
                    cache.remove_cache(record.pk)


def read_importers_again(app, env, added, changed, removed) -> list[str]:
    return [page for page in app.library_outdated if page not in added | changed]


def record_library(app, exception) -> None:
    if exception is None:
        _stamp(app).write_text(app.library_digest)


def setup(app) -> dict:
    # builder-inited comes before any document is read, so before myst-nb runs a chapter.
    app.connect("builder-inited", write_library)
    app.connect("env-get-outdated", read_importers_again)
    app.connect("build-finished", record_library)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
