"""The course's set-up promises: two commands, a CPU torch, chapters as MyST notebooks."""
import re
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
PROSE_PAGES = {"book/intro", "book/sources", "book/glossary", "book/bibliography", "book/errata", "book/contract"}


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def chapters() -> list[str]:
    return [f for f in toc_files() if f not in PROSE_PAGES]


def test_readme_quick_start_is_two_make_commands():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", quick_start, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make book", "make test"]


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", script, re.M)


def test_requirements_admit_the_local_cpu_torch_and_colab_releases():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_requirement = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    assert ".[book,grade]" in (ROOT / "requirements.txt").read_text().split()
    for version in ["2.13.0", "2.8.0", "2.9.1"]:
        assert torch_requirement.specifier.contains(Version(version)), version
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile


@pytest.mark.parametrize("page", toc_files())
def test_every_page_is_a_lowercase_hyphenated_myst_source(page):
    assert re.fullmatch(r"book/[a-z0-9]+(-[a-z0-9]+)*", page)
    source = ROOT / f"{page}.md"
    assert source.exists()


@pytest.mark.parametrize("page", toc_files())
def test_no_backtick_fence_has_a_backtick_in_its_title(page):
    """CommonMark ends a backtick fence's info string at a backtick: such a line opens no directive,
    and the rest of the page turns into a code block. Colon fences (:::) may quote code."""
    bad = [number for number, line in enumerate((ROOT / f"{page}.md").read_text().splitlines(), 1)
           if (fence := re.match(r"`{3,}", line)) and "`" in line[fence.end():]]
    assert not bad, f"{page}.md, lines {bad}: use a ::: fence or drop the backticks from the title"


@pytest.mark.parametrize("chapter", chapters())
def test_every_chapter_is_an_executable_notebook(chapter):
    text = (ROOT / f"{chapter}.md").read_text()
    front_matter = yaml.safe_load(text.split("---", 2)[1])
    assert front_matter["jupytext"]["text_representation"]["format_name"] == "myst"
    assert front_matter["kernelspec"]["name"] == "python3"
    assert "```{code-cell}" in text


@pytest.mark.parametrize("chapter", chapters())
def test_every_built_chapter_has_figures_exercises_and_citations(chapter):
    page = HTML / f"{chapter}.html"
    assert page.exists(), f"{page} missing: run `make book` first"
    html = page.read_text()
    assert re.search(r"<img[^>]+src=\"[^\"]*_images/", html), "no figure computed in the chapter"
    assert 'class="exercise' in html or "exercise admonition" in html, "no exercise"
    assert 'class="reference internal" href="bibliography.html' in html or "bibliography.html#id" in html, \
        "no citation"


SHARED_CONTRACT = ROOT.parent / "shared" / "spec" / "exercises.md"


@pytest.mark.skipif(not SHARED_CONTRACT.exists(), reason="the course's shared specification is not beside the clone")
def test_the_contract_page_is_the_exercise_specification():
    """Learners read the contract in the book; it is the specification the grader implements, word for word."""
    assert (ROOT / "book" / "contract.md").read_text() == SHARED_CONTRACT.read_text()
