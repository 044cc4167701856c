"""The course as a plain (not editable) install: a wheel holds the grader, its tests and their
configuration, and works from wherever the course's notebooks are."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.notebooks import ROOT, SEED

pytestmark = pytest.mark.timeout(600)


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
             "from autograde.grading.reference import namespace\nfrom autograde import registry, check\n"
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
