"""The grading benchmark at a tiny scale: its report's structure, and nbgrader's points equal to the
grader's for every (student, exercise) of a class that holds each kind of submission. Timings are
not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import grading_throughput as benchmark
from benchmarks.grading_throughput import Submission

pytestmark = [pytest.mark.xdist_group("benchmark_grading"), pytest.mark.slow, pytest.mark.timeout(900)]

STUDENTS = 2
ASSIGNMENT = "attention"
SEED = 12345  # draws, for 2 students, a reference answer, a partly done one and the untouched release
PAIRS = {(f"student{index:03d}", exercise) for index in (1, 2) for exercise in ("sdpa", "mha")}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return benchmark.run_benchmark(STUDENTS, [ASSIGNMENT], jobs=2, seed=SEED, skip_nbgrader=False,
                                   folder=tmp_path_factory.mktemp("benchmark"))


def test_the_class_holds_every_kind_of_submission(report):
    assert report["notebooks"] == len(PAIRS)
    assert sum(report["mix"].values()) == len(PAIRS)
    assert all(report["mix"][kind] > 0 for kind in ("solution", "wrong", "release")), report["mix"]


def test_nbgrader_gives_the_grader_points_for_every_student_and_exercise(report):
    assert {(row["student"], row["exercise"]) for row in report["grades"]} == PAIRS
    assert all(row["autograde"] is not None and row["nbgrader"] is not None for row in report["grades"])
    assert report["disagreements"] == [], report["disagreements"]
    assert {row["autograde"] for row in report["grades"]} >= {0.0, 10.0}


def test_the_report_has_the_machine_times_and_ratio(report):
    assert {"cpu", "cores", "torch"} <= set(report["machine"])
    for grader in ("autograde", "nbgrader"):
        assert report[f"{grader}_seconds"] > 0
        assert report[f"{grader}_seconds_per_notebook"] == pytest.approx(report[f"{grader}_seconds"] / len(PAIRS))
    # nbgrader's time over the mean of the grader's runs before and after it, on the same notebooks
    assert report["autograde_after_seconds"] > 0 and report["autograde_after_cpu_seconds"] > 0
    assert report["nbgrader_over_autograde"] == pytest.approx(
        2 * report["nbgrader_seconds"] / (report["autograde_seconds"] + report["autograde_after_seconds"]))
    assert report["nbgrader_over_autograde_cpu"] == pytest.approx(
        2 * report["nbgrader_cpu_seconds"] / (report["autograde_cpu_seconds"] + report["autograde_after_cpu_seconds"]))
    assert report["autograde_cpu_seconds"] > 0 and report["nbgrader_cpu_seconds"] > 0
    assert json.loads(json.dumps(report)) == report


def test_the_markdown_table_puts_both_graders_side_by_side(report):
    text = benchmark.markdown(report)
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 5 and "seconds per notebook" in table[0]
    assert "autograde grade" in table[2] and "nbgrader" in table[3] and "again after nbgrader" in table[4]
    assert "nbgrader / autograde on the whole class, the grader's two runs' mean:" in text
    assert f"points that differ: 0 of {len(PAIRS)}" in text


def test_a_difference_in_points_is_reported():
    submissions = [Submission("ada", ASSIGNMENT, "sdpa", "solution"), Submission("ada", ASSIGNMENT, "mha", "release")]
    ours = {("ada", "sdpa"): 10.0, ("ada", "mha"): 0.0}
    rows = benchmark.points_side_by_side(submissions, ours, {("ada", "sdpa"): 8.5, ("ada", "mha"): None})
    assert [row["agree"] for row in rows] == [False, False]
    assert all(row["agree"] for row in benchmark.points_side_by_side(submissions, ours, ours))


def test_the_class_is_drawn_from_the_seed(tmp_path: Path):
    first = benchmark.write_class(tmp_path / "a", 3, [ASSIGNMENT], SEED)
    assert benchmark.write_class(tmp_path / "b", 3, [ASSIGNMENT], SEED) == first
    assert sorted(p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*.ipynb")) == sorted(
        f"{s.student}/{ASSIGNMENT}/{s.exercise}.ipynb" for s in first)
    wrong = [s for s in first if s.kind.startswith("wrong:")]
    assert wrong and all(s.kind.removeprefix("wrong:") in benchmark.wrong_answers(s.exercise) for s in wrong)


def test_a_partly_done_notebook_leaves_only_its_last_graded_cell_as_released(tmp_path: Path):
    solution, partly, release = (benchmark.learner_notebook(Submission("ada", ASSIGNMENT, "mha", kind))
                                 for kind in ("solution", "wrong:load_torch_mha left as released", "release"))

    def graded(notebook):
        return {cell.metadata["nbgrader"]["grade_id"]: cell.source for cell in notebook.cells
                if cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)}
    cells = benchmark.solution_cell_ids(solution)
    assert graded(partly) == {**graded(solution), cells[-1]: graded(release)[cells[-1]]}
    assert all(graded(solution)[cell] != graded(release)[cell] for cell in cells)


def test_skip_nbgrader_times_the_grader_alone_with_its_scaling_and_each_exercise(tmp_path: Path, capsys):
    path = tmp_path / "report.json"
    status = benchmark.main(["--students", "1", "--assignment", ASSIGNMENT, "--jobs", "2", "--skip-nbgrader",
                             "--scaling", "--per-exercise", "1", "--json", str(path)])
    assert status == 0
    written = json.loads(path.read_text())
    assert written["notebooks"] == 2 and written["autograde_seconds"] > 0 and written["nbgrader_seconds"] is None
    assert [row["jobs"] for row in written["scaling"]] == [1, 2] and written["scaling_points_that_differ"] == []
    assert [row["exercise"] for row in written["per_exercise"]] == ["sdpa", "mha"]
    # Each notebook's own time, as the run recorded it: the first pays what a grading process pays once,
    # and the run's CPU seconds hold both notebooks and its start-up.
    assert all(row["scores"] == [10.0] and 0 < row["seconds_per_notebook"] < row["run_cpu_seconds"]
               and 0 < row["first_notebook_seconds"] < row["run_cpu_seconds"]
               for row in written["per_exercise"]), written["per_exercise"]
    out = capsys.readouterr().out
    assert "nbgrader: skipped" in out and "| sdpa |" in out and "| mha |" in out
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and " " not in line)
    assert {"autograde_seconds_per_notebook", "seconds_jobs_1", "seconds_jobs_2",
            "seconds_per_notebook_sdpa", "seconds_per_notebook_mha"} <= set(values)


def test_nbgrader_and_the_grader_can_be_compared_on_the_first_students(tmp_path: Path):
    subset = benchmark.run_benchmark(STUDENTS, [ASSIGNMENT], jobs=2, seed=SEED, skip_nbgrader=False,
                                     folder=tmp_path, nbgrader_students=1)
    assert subset["notebooks"] == len(PAIRS) and subset["nbgrader_notebooks"] == 2
    assert {(row["student"], row["exercise"]) for row in subset["grades"]} == {
        ("student001", "sdpa"), ("student001", "mha")}
    assert subset["disagreements"] == [], subset["disagreements"]
    assert subset["nbgrader_over_autograde"] == pytest.approx(
        2 * subset["nbgrader_seconds"] / (subset["autograde_subset_seconds"] + subset["autograde_after_seconds"]))
    text = benchmark.markdown(subset)
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 6 and "first 1 students only" in table[3] and "nbgrader" in table[4]
    assert "again after nbgrader, the first 1 students" in table[5]
    assert "extrapolated" not in text  # only the notebooks both graded are compared
