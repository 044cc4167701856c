"""Sphinx extension: the book's pages work as readers meet them.

- Colab opens notebooks, not MyST Markdown: each build writes every executable page as a
  notebook under ``notebooks/`` (committed, so that Colab finds it on GitHub) and points the
  page's Colab launch button at it; a build without a Colab button (the class edition,
  tools/class_edition.py) writes none. A notebook whose chapter imports the course's library
  (tools/course_library.py) starts by fetching it from the repository.
- A script that an extension registers after the HTML builder has started reaches the page
  twice (Sphinx 7 adds it once with filename None, once with ''), so sphinx-thebe's
  ``const THEBE_JS_URL`` is declared twice and the browser reports a SyntaxError on every
  page: script tags are de-duplicated.
- Live code (thebe) is off in ``launch_buttons``, yet sphinx-thebe still ships its scripts,
  stylesheet and a per-page kernel configuration naming a foreign Binder repository: they
  are left out of the pages.
- pydata-sphinx-theme 0.17 gives every page a header bar with a second search field unless
  ``navbar_persistent`` is set; sphinx-book-theme already has search in its sidebar.
"""
from __future__ import annotations

import json
from pathlib import Path

import jupytext
import yaml
from class_edition import TAG as GRADED_ANSWER_TAG
from course_library import MODULE as LIBRARY_MODULE
from course_library import NAME as LIBRARY_NAME
from course_library import ROOT, imports_library
from docutils import nodes
from pydata_sphinx_theme.utils import get_theme_options_dict
from sphinx.application import Sphinx

NOTEBOOK_DIR = "notebooks"
COLAB_SETUP_SOURCE = """\
# Colab set-up: glue() comes from myst-nb, which Colab does not ship.
import importlib.util
if importlib.util.find_spec("myst_nb") is None:
    %pip install --quiet myst-nb"""
THEBE_MARKERS = ("THEBE_JS_URL", "sphinx-thebe", "text/x-thebe-config", "kernelName = ")


def colab_notebook_path(docname: str) -> str:
    """Where the notebook of a page lives, relative to the repository root."""
    return f"{NOTEBOOK_DIR}/{docname.removeprefix('book/')}.ipynb"


def library_setup_source() -> str:
    """A cell that fetches the course's library, from where the Colab button finds the notebooks."""
    repository = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["repository"]
    raw = repository["url"].replace("https://github.com/", "https://raw.githubusercontent.com/")
    url = f"{raw}/{repository.get('branch', 'main')}/{LIBRARY_MODULE}"
    return f"""\
# Colab set-up: the course's library ({LIBRARY_MODULE}), whose functions earlier chapters define.
import os
import urllib.request
if not os.path.exists("{LIBRARY_NAME}.py"):
    urllib.request.urlretrieve("{url}", "{LIBRARY_NAME}.py")"""


def colab_notebook(markdown: str) -> str:
    """A MyST Markdown chapter as a notebook without outputs, ready to run in Colab."""
    notebook = jupytext.reads(markdown, fmt="md:myst")
    notebook.metadata.pop("jupytext", None)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    setups = [COLAB_SETUP_SOURCE] if any("myst_nb" in source for source in code) else []
    if any(imports_library(source) for source in code):
        setups.append(library_setup_source())
    for source in reversed(setups):
        notebook.cells[:0] = jupytext.reads(f"```{{code-cell}} ipython3\n{source}\n```\n", fmt="md:myst").cells
    for number, cell in enumerate(notebook.cells):
        cell.id = f"cell-{number}"  # stable ids: an unchanged chapter rewrites an identical file
        if GRADED_ANSWER_TAG in cell.metadata.get("tags", []):  # for the class edition's build only
            cell.metadata["tags"].remove(GRADED_ANSWER_TAG)
            if not cell.metadata["tags"]:
                del cell.metadata["tags"]
    return jupytext.writes(notebook, fmt="ipynb")


def _is_executable(app: Sphinx, docname: str) -> bool:
    return "kernelspec" in app.env.metadata.get(docname, {})


def write_colab_notebooks(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    if not app.config.html_theme_options.get("launch_buttons", {}).get("colab_url"):
        return
    for docname in sorted(app.env.all_docs):
        source = Path(app.env.doc2path(docname))
        if source.suffix != ".md" or not _is_executable(app, docname):
            continue
        target = Path(app.srcdir) / colab_notebook_path(docname)
        text = colab_notebook(source.read_text(encoding="utf-8"))
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")


def point_colab_at_notebook(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if context.get("page_source_suffix") != ".md":
        return  # a page written as a notebook already opens as itself
    branch = app.config.html_theme_options.get("repository_branch") or "master"  # the theme's default
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []) if group.get("label") == "launch-buttons" else []:
            if button.get("text") == "Colab":
                repository_part = button["url"].split(f"/blob/{branch}/", 1)[0]
                button["url"] = f"{repository_part}/blob/{branch}/{colab_notebook_path(pagename)}"


def _mentions_thebe(asset) -> bool:
    text = f"{asset.filename} {json.dumps(getattr(asset, 'attributes', {}), default=str)}"
    return any(marker in text for marker in THEBE_MARKERS)


def drop_duplicate_and_thebe_assets(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if app.config.html_theme_options.get("launch_buttons", {}).get("thebe"):
        return
    seen, scripts = set(), []
    for script in context.get("script_files", []):
        key = (script.filename or "", json.dumps(script.attributes, sort_keys=True, default=str))
        if key not in seen and not _mentions_thebe(script):
            seen.add(key)
            scripts.append(script)
    context["script_files"] = scripts
    context["css_files"] = [css for css in context.get("css_files", []) if not _mentions_thebe(css)]


def drop_thebe_kernel_configuration(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    if app.config.html_theme_options.get("launch_buttons", {}).get("thebe"):
        return
    for raw in list(doctree.findall(nodes.raw)):
        if any(marker in raw.astext() for marker in THEBE_MARKERS):
            raw.parent.remove(raw)


def drop_duplicate_search_header(app: Sphinx) -> None:
    get_theme_options_dict(app).setdefault("navbar_persistent", [])


def setup(app: Sphinx) -> dict:
    # Before pydata-sphinx-theme fills in its default header (builder-inited, priority 500).
    app.connect("builder-inited", drop_duplicate_search_header, priority=400)
    # After sphinx-thebe's doctree hook and the theme's launch buttons (both at <= 501).
    app.connect("doctree-resolved", drop_thebe_kernel_configuration, priority=900)
    app.connect("html-page-context", point_colab_at_notebook, priority=900)
    app.connect("html-page-context", drop_duplicate_and_thebe_assets, priority=900)
    app.connect("build-finished", write_colab_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
