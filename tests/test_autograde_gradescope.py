"""The Gradescope autograder: the zip that `python -m autograde.frontends.gradescope build` writes, and its
`run_autograder` on simulated submissions in a simulated /autograder, checked against
Gradescope's results.json specification."""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from autograde.frontends import gradescope
from autograde.grading.session import catalogue
from autograde.registry import EXERCISES
from autograde.submission import locate
from tests.fixtures.notebooks import ROOT, SEED, learner_notebook, write

pytestmark = [pytest.mark.xdist_group("autograde_gradescope"), pytest.mark.timeout(600)]

ASSIGNMENT = "attention"
EXERCISE_IDS = ("sdpa", "mha")
CASES = {f"{e.id}: {c.name}" + ("" if c.visible else " (hidden)"): c
         for e in EXERCISES.values() if e.assignment == ASSIGNMENT for c in catalogue(e)}
TOP_LEVEL_KEYS = {"score", "execution_time", "output", "tests"}
TEST_KEYS = {"name", "number", "score", "max_score", "status", "output", "visibility"}


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory) -> Path:
    return gradescope.build(tmp_path_factory.mktemp("build") / "autograder.zip", SEED, [ASSIGNMENT])


def run_autograder(autograder_zip: Path, tmp_path: Path, uploads: dict) -> tuple[dict, str, Path]:
    """Gradescope's layout under tmp_path/autograder, the uploads (path: notebook, bytes, or a
    link's target) in submission/, and run_autograder run as Gradescope runs it."""
    root = tmp_path / "autograder"
    with zipfile.ZipFile(autograder_zip) as archive:
        archive.extractall(root / "source")
    submission = root / "submission"
    submission.mkdir()
    for name, content in uploads.items():
        path = submission / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, Path):
            path.symlink_to(content)
        else:
            write(content, path)
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "AUTOGRADE_PYTHON": sys.executable}
    env.pop("AUTOGRADE_SEED", None)  # the seed comes from the zip
    process = subprocess.run(["bash", str(root / "source" / "run_autograder")], cwd=root, env=env,
                             capture_output=True, text=True, timeout=540)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return json.loads((root / "results" / "results.json").read_text()), process.stdout, root


def check_specification(results: dict) -> None:
    """results.json as Gradescope reads it: one test per case, hidden ones shown after publishing."""
    assert set(results) == TOP_LEVEL_KEYS
    assert isinstance(results["output"], str) and isinstance(results["execution_time"], int)
    tests = results["tests"]
    assert [test["name"] for test in tests] == list(CASES)
    for test in tests:
        case = CASES[test["name"]]
        assert set(test) == TEST_KEYS, test
        assert test["status"] in ("passed", "failed")
        assert test["visibility"] == ("visible" if case.visible else "after_published")
        assert test["max_score"] == case.points and 0 <= test["score"] <= test["max_score"]
        assert isinstance(test["output"], str) and test["output"]
    assert results["score"] == pytest.approx(sum(test["score"] for test in tests))


def by_exercise(results: dict, exercise_id: str) -> list[dict]:
    return [test for test in results["tests"] if test["name"].startswith(f"{exercise_id}: ")]


@pytest.mark.slow  # builds and runs the autograder
def test_reference_answers_score_full_marks(autograder_zip, tmp_path):
    results, stdout, root = run_autograder(autograder_zip, tmp_path, {
        "sdpa.ipynb": learner_notebook("sdpa"),  # the release, answered with the reference
        "attention/mha.ipynb": (ROOT / "solutions" / "attention" / "mha.ipynb").read_bytes(),
    })
    check_specification(results)
    assert results["score"] == 20
    assert {test["status"] for test in results["tests"]} == {"passed"}
    assert all(test["score"] == test["max_score"] for test in results["tests"])
    hidden = [test for test in results["tests"] if test["visibility"] == "after_published"]
    assert hidden and {test["output"] for test in hidden} == {"hidden test passed"}
    assert "graded sdpa.ipynb" in results["output"] and "graded attention/mha.ipynb" in results["output"]
    assert "hidden tests (4 points) when the grades are published" in results["output"]
    # Graded by the zip's copy of the course, with the zip's seed; its secrets closed to others.
    assert f"with the course in {root / 'source'}: attention\n" in stdout
    assert str(SEED) not in stdout  # the log names no seed: it may be shown to students
    for folder in ("source", "results"):
        assert stat.S_IMODE((root / folder).stat().st_mode) == 0o700


@pytest.mark.slow  # builds and runs the autograder
def test_released_notebooks_score_zero_and_hidden_tests_say_only_failed(autograder_zip, tmp_path):
    results, _, _ = run_autograder(autograder_zip, tmp_path, {
        f"{e}.ipynb": (ROOT / "exercises" / ASSIGNMENT / f"{e}.ipynb").read_bytes() for e in EXERCISE_IDS})
    check_specification(results)
    assert results["score"] == 0
    assert {test["status"] for test in results["tests"]} == {"failed"}
    visible = [test for test in results["tests"] if test["visibility"] == "visible"]
    assert all("inputs: " in test["output"] for test in visible)
    hidden = [test for test in results["tests"] if test["visibility"] == "after_published"]
    assert {test["output"] for test in hidden} == {"hidden test failed"}


@pytest.mark.slow  # builds and runs the autograder
def test_renamed_malformed_and_stray_notebooks(autograder_zip, tmp_path):
    results, _, _ = run_autograder(autograder_zip, tmp_path, {
        "Downloads/sdpa (1).ipynb": learner_notebook("sdpa"),
        "mha.ipynb": b'{"cells": [',
        "scratch.ipynb": learner_notebook("mha"),
    })
    check_specification(results)
    assert results["score"] == 10
    assert {test["status"] for test in by_exercise(results, "sdpa")} == {"passed"}
    assert "graded Downloads/sdpa (1).ipynb as sdpa.ipynb: it looks renamed" in results["output"]
    for test in by_exercise(results, "mha"):
        assert (test["score"], test["status"]) == (0, "failed")
        assert test["output"].startswith("0 points: invalid: mha.ipynb is not a notebook: not valid JSON")
    assert "scratch.ipynb was not graded" in results["output"]


@pytest.mark.slow  # builds and runs the autograder
def test_missing_notebooks_and_links_score_zero_with_the_reason(autograder_zip, tmp_path):
    solution = tmp_path / "autograder" / "source" / "solutions" / ASSIGNMENT / "sdpa.ipynb"
    results, _, _ = run_autograder(autograder_zip, tmp_path, {"sdpa.ipynb": solution})
    check_specification(results)
    assert results["score"] == 0
    for exercise_id in EXERCISE_IDS:
        outputs = {test["output"] for test in by_exercise(results, exercise_id)}
        assert outputs == {f"0 points: missing: no {exercise_id}.ipynb was uploaded"}
    assert "sdpa.ipynb is a link, not a file: not graded" in results["output"]


@pytest.mark.slow  # builds and runs the autograder
def test_zip_holds_the_scripts_the_course_and_the_seed(autograder_zip, tmp_path):
    with zipfile.ZipFile(autograder_zip) as archive:
        modes = {info.filename: info.external_attr >> 16 for info in archive.infolist()}
        config = json.loads(archive.read("gradescope.json"))
        archive.extractall(tmp_path)
    for script in ("setup.sh", "run_autograder"):
        assert modes[script] & 0o111 == 0o111, script
        check = subprocess.run(["bash", "-n", str(tmp_path / script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert config == {"seed": SEED, "assignments": [ASSIGNMENT]}
    for folder in ("solutions", "exercises"):
        assert sorted(name for name in modes if name.startswith(f"{folder}/")) == \
            [f"{folder}/{ASSIGNMENT}/{e}.ipynb" for e in sorted(EXERCISE_IDS)]
    assert {"requirements.txt", "autograde/grading/grade.py", "autograde/tests/test_sdpa.py",
            "autograde/tests/conftest.py", "autograde/tests/pytest.ini"} <= set(modes)
    assert not [name for name in modes
                if "__pycache__" in name or name.startswith("autograde/frontends/gradescope_files")]


def installed_by_setup(autograder_zip: Path) -> list[str]:
    with zipfile.ZipFile(autograder_zip) as archive:
        requirements = archive.read("requirements.txt").decode().splitlines()
        setup = archive.read("setup.sh").decode()
    torch = re.search(r'--index-url https://download.pytorch.org/whl/cpu "(torch[^"]*)"', setup).group(1)
    return [torch] + [line for line in requirements if line and not line.startswith("#")]


@pytest.mark.slow  # builds and runs the autograder
def test_setup_installs_the_course_requirement_ranges(autograder_zip):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(installed_by_setup(autograder_zip)) == \
        sorted(project["dependencies"] + project["optional-dependencies"]["grade"])


@pytest.mark.slow  # builds and runs the autograder
def test_setup_installs_every_package_the_grader_imports(autograder_zip):
    installed = {re.match(r"[\w-]+", requirement).group(0) for requirement in installed_by_setup(autograder_zip)}
    installed.add("traitlets")  # with nbformat and nbgrader
    installed.add("markdown_it")  # the import name of markdown-it-py
    installed.add("_pytest")  # pytest's implementation, installed with it
    imported = set()
    for path in (ROOT / "autograde").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) - {"autograde", "__future__"} <= installed


def test_build_command_takes_the_seed_from_the_environment(tmp_path):
    out = tmp_path / "autograder.zip"
    process = subprocess.run(
        [sys.executable, "-m", "autograde.frontends.gradescope", "build", "--out", str(out), "--assignment", "gqa"],
        cwd=ROOT, env={**os.environ, "AUTOGRADE_SEED": "4242"}, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert "seed 4242" in process.stdout
    with zipfile.ZipFile(out) as archive:
        assert json.loads(archive.read("gradescope.json")) == {"seed": 4242, "assignments": ["gqa"]}


def test_build_without_a_seed_draws_and_prints_one(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AUTOGRADE_SEED", raising=False)
    out = tmp_path / "autograder.zip"
    assert gradescope.main(["build", "--out", str(out)]) == 0
    with zipfile.ZipFile(out) as archive:
        config = json.loads(archive.read("gradescope.json"))
    assert f"seed {config['seed']} " in capsys.readouterr().out
    assert config["assignments"] == list(dict.fromkeys(e.assignment for e in EXERCISES.values()))
    assert gradescope.main(["build", "--out", str(out), "--assignment", "nope"]) == 2
    assert "unknown assignment(s): nope" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "exercise_id", "expected"), [
    ("sdpa (1)", "sdpa", True), ("Copy of kv_cache", "kv_cache", True), ("SDPA-final", "sdpa", True),
    ("flash_forward", "flash_backward", False), ("sdpaX", "sdpa", False), ("notes", "mha", False),
])
def test_renamed_notebooks_are_recognised_by_the_exercise_name(name, exercise_id, expected):
    assert locate.looks_like(name, exercise_id) is expected


def test_notebooks_are_found_by_name_at_any_depth_and_never_guessed_between_two(tmp_path):
    for name in ("attention/sdpa.ipynb", "sdpa.ipynb", "mha_v1.ipynb", "mha (2).ipynb",
                 ".ipynb_checkpoints/mha.ipynb", "__MACOSX/mha.ipynb", "gqa.ipynb"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    exercises = [e for e in EXERCISES.values() if e.assignment == ASSIGNMENT]
    (sdpa, mha), notes = locate.find_all(exercises, tmp_path)
    assert sdpa == locate.Found(tmp_path / "attention" / "sdpa.ipynb",
                                    "graded attention/sdpa.ipynb; not graded, by the same name: sdpa.ipynb")
    assert mha == locate.Found(None, "no mha.ipynb was uploaded, and several notebooks look like it "
                                         "(mha (2).ipynb, mha_v1.ipynb): upload one, named mha.ipynb")
    assert notes == [f"{name} was not graded: this assignment grades sdpa.ipynb and mha.ipynb"
                     for name in ("gqa.ipynb", "mha (2).ipynb", "mha_v1.ipynb")]


def test_the_private_copy_keeps_a_notebook_over_the_limit_whole_so_its_real_size_is_reported(tmp_path):
    uploaded = tmp_path / "sdpa.ipynb"
    uploaded.write_bytes(b" " * (22 * 2**20))
    (tmp_path / "copies").mkdir()
    copy = gradescope.private_copy(uploaded, tmp_path / "copies")
    assert copy.stat().st_size == uploaded.stat().st_size
