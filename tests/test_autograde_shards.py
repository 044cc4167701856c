"""A class graded in shards (`grade --shard K/N`) and merged (`merge`) is the class graded in one run.

The shards run through the committed Slurm recipe as it is (outside Slurm, with the array
variables a job array would set); the merge must refuse shards that do not belong together.
"""

from __future__ import annotations

import csv
import filecmp
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autograde.frontends import cli
from autograde.grading import class_report, provenance
from tests.conftest import CLASS_EXPECTED
from tests.fixtures.notebooks import ROOT, SEED

pytestmark = [pytest.mark.xdist_group("autograde_shards"), pytest.mark.slow, pytest.mark.timeout(600)]

DEPLOY = ROOT / "autograde" / "deploy"
SHARDS = 3


def merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autograde", "merge", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def sharded(class_grades, tmp_path_factory) -> Path:
    """The class of `class_grades`, graded by the Slurm recipe as SHARDS array tasks, then merged."""
    out = tmp_path_factory.mktemp("sharded")
    environment = {**os.environ, "AUTOGRADE_SEED": str(SEED), "PYTHON": sys.executable,
                   "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": str(SHARDS), "SLURM_CPUS_PER_TASK": "2"}
    for shard in range(1, SHARDS + 1):
        task = subprocess.run(["bash", str(DEPLOY / "slurm-array.sh"), str(class_grades.submitted), str(out)],
                              env={**environment, "SLURM_ARRAY_TASK_ID": str(shard)}, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert task.returncode == 0, task.stderr
    merged = subprocess.run(["bash", str(DEPLOY / "slurm-array.sh"), "--merge", str(out)], env=environment,
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    return out


def without_timings(report: Path) -> str:
    """The class report but its slowest notebooks, which show the times measured in each run."""
    before, heading, after = report.read_text().partition(class_report.SLOWEST_HEADING)
    assert heading and after.count("<table>") == 1, "the slowest notebooks' section is the report's last"
    return before + after[after.index("</table>"):]


def test_shards_split_the_class_by_a_stable_hash_that_keeps_a_students_folders_together():
    students = sorted(CLASS_EXPECTED) + ["Ada ", "ADA"]
    assert {provenance.shard_of(s, SHARDS) for s in students} <= set(range(1, SHARDS + 1))
    assert provenance.shard_of("Ada ", 7) == provenance.shard_of("ada", 7) == provenance.shard_of("ADA", 7)
    assert provenance.parse_shard("2/8") == (2, 8)
    for wrong in ("0/3", "4/3", "3", "a/b"):
        with pytest.raises(ValueError):
            provenance.parse_shard(wrong)


def test_the_shards_merged_give_the_grades_of_one_run_byte_for_byte(class_grades, sharded):
    merged = sharded / "class"
    assert (merged / "grades.csv").read_bytes() == (class_grades.out / "grades.csv").read_bytes()
    comparison = filecmp.dircmp(merged / "feedback", class_grades.out / "feedback")
    assert not comparison.left_only and not comparison.right_only and not comparison.diff_files
    for name in ("results.csv", "canvas.csv", "moodle.csv"):
        assert (merged / name).read_bytes() == (class_grades.out / name).read_bytes(), name
    assert without_timings(merged / "report.html") == without_timings(class_grades.out / "report.html")
    graded = [{r["student"] for r in csv.DictReader((sharded / f"shard-{k}" / "grades.csv").open())}
              for k in range(1, SHARDS + 1)]
    assert sum(map(len, graded)) == len(CLASS_EXPECTED) and set().union(*graded) == set(CLASS_EXPECTED)


def test_the_merge_refuses_shards_that_do_not_add_up_to_one_class(sharded, tmp_path):
    shards = [str(sharded / f"shard-{k}") for k in range(1, SHARDS + 1)]
    refused = {
        "missing 2/3": merge(shards[0], shards[2], "--out", str(tmp_path / "a")),
        "given twice 1/3": merge(shards[0], shards[0], shards[1], shards[2], "--out", str(tmp_path / "b")),
    }
    other_seed = tmp_path / "other-seed"
    shutil.copytree(sharded / "shard-2", other_seed)
    with sqlite3.connect(other_seed / "journal.sqlite3") as db:
        db.execute("update run set value = '7' where key = 'seed'")
    refused["different seed"] = merge(shards[0], str(other_seed), shards[2], "--out", str(tmp_path / "c"))
    unfinished = tmp_path / "unfinished"
    shutil.copytree(sharded / "shard-1", unfinished)
    with sqlite3.connect(unfinished / "journal.sqlite3") as db:
        if db.execute("select count(*) from grades").fetchone()[0] == 0:
            pytest.fail("shard 1 graded nobody: choose a class in which every shard has a student")
        db.execute("delete from grades where rowid = (select min(rowid) from grades)")
    refused["has not finished"] = merge(str(unfinished), shards[1], shards[2], "--out", str(tmp_path / "d"))
    for expected, process in refused.items():
        assert process.returncode == 2 and expected in process.stderr, (expected, process.stderr)
    assert not any((tmp_path / name / "grades.csv").exists() for name in "abcd")


def test_grading_some_shards_again_needs_their_number(tmp_path):
    """`sbatch --array=3` alone would cut the class in 3: the recipe asks for SHARDS instead."""
    environment = {**os.environ, "AUTOGRADE_SEED": str(SEED), "PYTHON": "false", "SLURM_ARRAY_TASK_ID": "3",
                   "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "3"}
    task = subprocess.run(["bash", str(DEPLOY / "slurm-array.sh"), str(tmp_path), str(tmp_path)], env=environment,
                          capture_output=True, text=True, timeout=30)
    assert task.returncode == 2 and "set SHARDS" in task.stderr, task.stderr
    shown = subprocess.run(["bash", "-x", str(DEPLOY / "slurm-array.sh"), str(tmp_path), str(tmp_path)],
                           env={**environment, "SHARDS": "8"}, capture_output=True, text=True, timeout=30)
    assert "--shard 3/8" in shown.stderr, shown.stderr  # PYTHON=false: the command shown, nothing graded


def test_a_shard_needs_the_classs_seed(class_grades, tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != "AUTOGRADE_SEED"}
    process = subprocess.run([sys.executable, "-m", "autograde", "grade", str(class_grades.submitted),
                              "--out", str(tmp_path), "--shard", "1/2"], env=environment, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2 and "same hidden tests" in process.stderr


def _grade_arguments(command: str, substitutions: dict[str, str]) -> list[str]:
    for name, value in substitutions.items():
        command = command.replace(name, value)
    words = shlex.split(command)
    return words[words.index("autograde") + 1:]


def test_the_kubernetes_and_github_recipes_grade_every_shard_once_with_the_graders_own_arguments():
    parser = cli.build_parser()
    shards_job, merge_job = yaml.safe_load_all((DEPLOY / "kubernetes-indexed-job.yaml").read_text())
    spec = shards_job["spec"]
    assert spec["completionMode"] == "Indexed"
    count = spec["completions"]
    container = spec["template"]["spec"]["containers"][0]
    for index in range(count):
        args = parser.parse_args(_grade_arguments(container["args"][0], {
            "$((JOB_COMPLETION_INDEX + 1))": str(index + 1)}))
        assert args.command == "grade" and args.shard == (index + 1, count) and args.resume
    assert parser.parse_args(_grade_arguments(merge_job["spec"]["template"]["spec"]["containers"][0]["args"][0],
                                              {})).command == "merge"

    workflow = yaml.safe_load((DEPLOY / "github-actions.yml").read_text())
    matrix = workflow["jobs"]["shards"]["strategy"]["matrix"]["shard"]
    grade_step = next(s["run"] for s in workflow["jobs"]["shards"]["steps"] if "autograde grade" in s.get("run", ""))
    for shard in matrix:
        args = parser.parse_args(_grade_arguments(grade_step, {"${{ matrix.shard }}": str(shard)}))
        assert args.shard == (shard, len(matrix))
    assert sorted(matrix) == list(range(1, len(matrix) + 1))
    merge_step = next(s["run"] for s in workflow["jobs"]["merge"]["steps"] if "autograde merge" in s.get("run", ""))
    assert parser.parse_args(_grade_arguments(merge_step, {})).command == "merge"
