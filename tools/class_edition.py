"""Sphinx extension: the class edition, a build of the book without the graded answers.

A code cell tagged ``graded-answer`` defines a function or class that a graded exercise asks
for (or the chapter's own version of it). The open edition shows it like any other cell. The
class edition (``book_edition = "class"``, by default from the ``BOOK_EDITION`` environment
variable) still executes it, since later cells and figures use what it defines, but leaves its
source out of everything a learner can reach:

- the page and the search index: the cell's input is removed from the doctree as soon as the
  document is read, so no later step (HTML writer, search indexer) ever sees it;
- downloadable sources: no ``_sources/`` copy and no download button;
- launch buttons: no Colab, Binder or JupyterHub links, whose notebooks would hold the code
  (sphinx-book-theme would also copy the executed notebook into ``_sources/`` for them), and
  no ``notebooks/`` written for Colab (tools/book_site.py writes them only for a Colab button);
- repository and issues buttons: the repository holds ``solutions/``.
"""
from __future__ import annotations

import os

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ConfigError

TAG = "graded-answer"
EDITIONS = ("open", "class")
PLACEHOLDER = "Code left out of this edition: it answers a graded exercise."


def _check_edition(app: Sphinx, config: Config) -> None:
    if config.book_edition not in EDITIONS:
        raise ConfigError(f"book_edition must be one of {', '.join(EDITIONS)}, not {config.book_edition!r}")


def leave_out_sources_and_buttons(app: Sphinx, config: Config) -> None:
    if config.book_edition != "class":
        return
    config.html_copy_source = False
    config.html_show_sourcelink = False
    config.html_theme_options = {
        **config.html_theme_options,
        "launch_buttons": {},
        "use_download_button": False,
        "use_repository_button": False,
        "use_issues_button": False,
    }


def is_graded_answer(node: nodes.Node) -> bool:
    """A myst-nb code cell whose metadata carries the tag."""
    return (isinstance(node, nodes.container) and node.get("nb_element") == "cell_code"
            and TAG in node.get("cell_metadata", {}).get("tags", []))


def remove_graded_sources(app: Sphinx, doctree: nodes.document) -> None:
    for cell in list(doctree.findall(is_graded_answer)):
        # myst-nb turns each tag into a class; the tag is for this build, not for readers.
        cell["classes"] = [name for name in cell["classes"] if name != f"tag_{TAG}"]
        if app.config.book_edition != "class":
            continue
        for source in [child for child in cell.children if child.get("nb_element") == "cell_code_source"]:
            # A line in its place, so that the outputs below do not seem to come from nowhere.
            note = nodes.paragraph(classes=["graded-answer-left-out"])
            note += nodes.emphasis(text=PLACEHOLDER)
            cell.replace(source, note)


def setup(app: Sphinx) -> dict:
    app.add_config_value("book_edition", os.environ.get("BOOK_EDITION", "open"), "env", types=[str])
    # Early, before the themes read their options (builder-inited) or copy anything.
    app.connect("config-inited", _check_edition, priority=100)
    app.connect("config-inited", leave_out_sources_and_buttons, priority=100)
    app.connect("doctree-read", remove_graded_sources)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
