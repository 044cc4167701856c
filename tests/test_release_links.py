"""`release --book-url --repository`: a class's notebooks link to its own edition and repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from autograde.frontends import cli, release
from autograde.registry import EXERCISES
from tests.fixtures.notebooks import ROOT

CLASS_BOOK = "https://course.example.edu/mha-2027/"
CLASS_REPOSITORY = "https://github.com/example-university/mha-2027-class"


def cells_text(path: Path) -> str:
    return "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells)


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_every_link_to_the_open_edition_points_at_the_class_edition(exercise_id: str):
    text = cells_text(ROOT / "solutions" / EXERCISES[exercise_id].notebook)
    book_links, repository_links = text.count(release.OPEN_BOOK), text.count(release.OPEN_REPOSITORY)
    assert book_links and repository_links  # the notebook links to both: the rewrite has work to do
    relinked = release.relinked(text, CLASS_BOOK, CLASS_REPOSITORY)
    assert "mha-derived.github.io" not in relinked and "github.com/mha-derived" not in relinked
    assert relinked.count(CLASS_BOOK) == book_links
    assert f'COURSE_REPOSITORY = "{CLASS_REPOSITORY}"' in relinked
    colab = "https://colab.research.google.com/github/example-university/mha-2027-class/blob/main/"
    assert f"{colab}exercises/{EXERCISES[exercise_id].notebook}" in relinked
    assert release.relinked(text) == text  # by default, the open edition's


def test_a_repository_off_github_gets_no_colab_badge():
    text = cells_text(ROOT / "solutions" / "attention" / "sdpa.ipynb")
    relinked = release.relinked(text, CLASS_BOOK, "https://gitlab.example.edu/mha/class.git")
    assert "colab.research.google.com" not in relinked and "github.com/mha-derived" not in relinked
    assert 'COURSE_REPOSITORY = "https://gitlab.example.edu/mha/class.git"' in relinked


def test_release_refuses_a_url_that_would_break_the_set_up_cell(capsys):
    with pytest.raises(release.LinkError, match="repository's URL"):
        release.release(repository='https://github.com/x/y" ; import os')
    assert cli.main(["release", "--book-url", "course.example.edu"]) == 2
    assert "the book's URL must be an http(s) URL" in capsys.readouterr().err


@pytest.mark.slow
def test_a_class_release_links_to_the_class_edition_and_checks_the_same(tmp_path: Path):
    solutions = tmp_path / "solutions"
    shutil.copytree(ROOT / "solutions", solutions)
    written = release.release(solutions, tmp_path / "exercises", CLASS_BOOK, CLASS_REPOSITORY)
    notebooks = [path for path in written if path.suffix == ".ipynb"]
    assert len(notebooks) == len(EXERCISES)
    for path in notebooks:
        text = cells_text(path)
        assert "mha-derived.github.io" not in text and "github.com/mha-derived" not in text, path
        assert CLASS_BOOK in text and CLASS_REPOSITORY in text
        nbgrader = [cell.metadata.nbgrader for cell in nbformat.read(path, as_version=4).cells
                    if "nbgrader" in cell.metadata]
        assert nbgrader and all("checksum" in cell for cell in nbgrader)  # computed on the class's links
    assert len([path for path in written if path.name.endswith(".expected.zip")]) == len(EXERCISES)
    assert json.loads((solutions / "attention" / "sdpa.ipynb").read_text()) == json.loads(
        (ROOT / "solutions" / "attention" / "sdpa.ipynb").read_text())  # the sources keep the open links
