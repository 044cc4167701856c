"""The course as a plain (not editable) install: a wheel holds the grader, its tests and their
configuration, and works from wherever the course's notebooks are."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import nbformat
import pytest

from tests.fixtures.implementations import SDPA_WRONG
from tests.fixtures.notebooks import ROOT, SEED, answer

pytestmark = [pytest.mark.xdist_group("packaging"), pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel that `pip install .` would install, unpacked into a folder of its own."""
    base = tmp_path_factory.mktemp("installed")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(base / "wheel"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (base / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(base / "site")
    return base / "site"


def run(installed: Path, *arguments: str, cwd: Path, **environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed), **environment}
    return subprocess.run([sys.executable, *arguments], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_wheel_holds_the_tests_and_their_configuration(installed: Path):
    for path in ("autograde/tests/test_sdpa.py", "autograde/tests/conftest.py", "autograde/tests/pytest.ini",
                 "autograde/frontends/gradescope_files/setup.sh"):
        assert (installed / path).is_file(), path
    assert not (installed / "solutions").exists()


def test_check_works_from_the_course_folder(installed: Path):
    check = ("import autograde, sys\n"
             f"assert autograde.__file__.startswith({str(installed)!r}), autograde.__file__\n"
             "from autograde.solutions import namespace\nfrom autograde import registry, check\n"
             "check('sdpa', namespace=dict(namespace(registry.get('sdpa'))))")
    result = run(installed, "-c", check, cwd=ROOT / "exercises" / "attention")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith('check("sdpa"): 6 of 6 points')


def test_the_class_grader_works_with_the_course_named(installed: Path, tmp_path: Path):
    submitted = tmp_path / "submitted" / "ada" / "attention"
    submitted.mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / "attention" / "sdpa.ipynb", submitted / "sdpa.ipynb")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = run(installed, "-m", "autograde", "grade", str(tmp_path / "submitted"), "--out", str(tmp_path / "out"),
                  "--seed", str(SEED), cwd=elsewhere)
    assert missing.returncode != 0 and "AUTOGRADE_COURSE" in missing.stderr
    graded = run(installed, "-m", "autograde", "grade", str(tmp_path / "submitted"), "--out", str(tmp_path / "out"),
                 "--seed", str(SEED), "--jobs", "1", "--assignment", "attention", cwd=elsewhere,
                 AUTOGRADE_COURSE=str(ROOT))
    assert graded.returncode == 0, graded.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "out" / "grades.csv").open()))
    assert [(r["exercise"], r["score"]) for r in rows] == [("sdpa", "10"), ("mha", "0")]


def test_every_module_of_the_package_is_in_the_wheel(installed: Path):
    # pyproject.toml lists the packages (one of them is read from exercises/): none may be left out.
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "autograde").rglob("*.py")}
    assert modules == {path.relative_to(installed).as_posix() for path in (installed / "autograde").rglob("*.py")}
    released = {path.relative_to(ROOT / "exercises") for path in (ROOT / "exercises").glob("*/*.expected.zip")}
    assert released and released == {path.relative_to(installed / "autograde" / "released")
                                      for path in (installed / "autograde" / "released").glob("*/*")}


LEARNER_CELLS = """
import json, sys
import nbformat
from nbclient import NotebookClient
notebook = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(notebook, timeout=240, kernel_name="python3", allow_errors=True).execute()
print(json.dumps([[output.get("text", "") + output.get("evalue", "") for output in cell.outputs]
                  for cell in notebook.cells]))
"""


def run_notebook(python: Path, cells: list[str], folder: Path) -> list[str]:
    """Each cell's printed text (and error), run by a kernel of `python` in `folder`."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbformat.write(notebook, folder / "mine.ipynb")
    (folder / "run.py").write_text(LEARNER_CELLS)
    result = subprocess.run([str(python), "run.py", "mine.ipynb"], cwd=folder, capture_output=True, text=True,
                            timeout=400, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr[-2000:]
    (folder / "run.py").unlink()
    return ["".join(outputs) for outputs in json.loads(result.stdout)]


@pytest.mark.slow
def test_a_learner_installs_the_course_and_checks_a_notebook_anywhere(tmp_path: Path):
    """`pip install .` in a class's copy of the course, then check() in a notebook of an empty folder."""
    copy = tmp_path / "class-copy"  # what DEPLOYING.md's class copy holds
    for name in ("autograde", "exercises", "tools"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    before = sorted(path.relative_to(copy) for path in copy.rglob("*"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # torch, pytest, Jupyter and pip from the course's environment, offline; autograde from the install
    (Path(site) / "course-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "."],
                               cwd=copy, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert sorted(path.relative_to(copy) for path in copy.rglob("*")) == before  # no build/, no *.egg-info/

    empty = tmp_path / "my-notebooks"
    empty.mkdir()
    right = answer("sdpa", "scaled_dot_product_attention") + "\n\n" + answer("sdpa", "causal_mask")
    [wrong] = [variant for variant in SDPA_WRONG if variant.name == "no-scaling"]
    check = 'from autograde import check\ncheck("sdpa")'
    where, right_check, wrong_check = run_notebook(python, [
        "import autograde\nprint(autograde.__file__)", right, check,
        wrong.answers["scaled_dot_product_attention"], check], empty)[::2]
    assert where.startswith(site), where
    assert right_check.strip().splitlines()[-1].startswith('check("sdpa"): 6 of 6 points'), right_check
    assert "FAIL" not in right_check
    assert "FAIL" in wrong_check and 'check("sdpa"): 6 of 6' not in wrong_check, wrong_check

    # an install without the expected values: one error that says what to do, not failing tests
    shutil.rmtree(Path(site) / "autograde" / "released")
    [error] = run_notebook(python, [right + "\n" + check], empty)
    assert "pip install ." in error and "FAIL" not in error and error.count("expected values") == 1, error


@pytest.mark.parametrize("page, start", [("README.md", "## For learners\n"),
                                         ("book/intro.md", "### Setting up for the exercises\n")])
def test_the_learners_set_up_installs_what_the_exercises_need_and_no_more(page: str, start: str):
    text = (ROOT / page).read_text()
    section = text[text.index(start):]
    section = section[:section.index("\n#", len(start))] if "\n#" in section[len(start):] else section
    installs = [line for line in section.splitlines() if line.lstrip().startswith("pip install")]
    assert "pip install .                    # the checks: torch, numpy, nbformat and pytest" in section
    assert any("jupyterlab" in line for line in installs) and "jupyter lab exercises/" in section
    assert not any(word in line for line in installs for word in ("-r ", "requirements", "[book", "[grade", "nbgrader",
                                                                  "sphinx", "jupyter-book"))
    assert 'check("sdpa")' in section and "hidden tests" in section
    # what the section says `pip install .` brings is what pyproject.toml declares
    declared = [r for r in importlib.metadata.requires("mha-derived") if "extra ==" not in r]
    assert sorted(re.match(r"[a-z]+", requirement).group() for requirement in declared) == [
        "nbformat", "numpy", "pytest", "torch"]
