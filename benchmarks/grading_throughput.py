"""Grading a class: `python -m autograde grade` against `nbgrader autograde`, same notebooks, same machine.

    python -m benchmarks.grading_throughput                       # 50 students, every assignment
    python -m benchmarks.grading_throughput --students 2 --assignment attention   # a smoke run
    python -m benchmarks.grading_throughput --students 500 --nbgrader-students 20    # a large class

It writes a synthetic class in a temporary folder, in nbgrader's layout
`submitted/<student>/<assignment>/<exercise>.ipynb`: every student hands in every exercise of
the chosen assignments, each notebook drawn from the seed out of a realistic mix (the reference
answers, the untouched release, or one of the wrong answers of `tests/fixtures/implementations.py`
that fits the exercise). Then, one after the other in the same run, it times

1. the course's grader, `python -m autograde grade <submitted> --seed S --jobs N`;
2. nbgrader as a course runs it: `generate_assignment`, then `autograde --force` (its default,
   one notebook after the other), for each assignment, with `AUTOGRADE_SEED=S` so that its
   hidden tests draw the same inputs.

With `--nbgrader-students K`, nbgrader grades only the first K students (it takes about 20 times
longer per notebook), and the grader grades them again on their own, so that the ratio compares
the same notebooks, timed one after the other in the same run.

It prints the machine, the wall time of each and per notebook, nbgrader's time over the
grader's on the same notebooks, and the (student, exercise) pairs where the two give different
points: the test cells and the grader run the same tests, so any disagreement is a bug in one
of them, and the command then exits 1. `--json PATH` also writes the numbers and every pair's points.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from autograde import registry as exercises
from tests.fixtures import implementations
from tests.fixtures.notebooks import learner_notebook, write

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = ("attention", "gqa", "flash")
# How a class hands in an exercise: most solve it, many get part of it wrong, a few hand in the release.
MIX = {"solution": 0.5, "wrong": 0.35, "release": 0.15}
NBGRADER_CELL_SECONDS = 300  # --Execute.timeout: the grader's own default wall time per notebook
SHOWN_DISAGREEMENTS = 5


@dataclass(frozen=True)
class Submission:
    student: str
    assignment: str
    exercise: str
    kind: str  # "solution", "release" or "wrong:<name of the wrong answer>"


def machine_description() -> dict[str, str]:
    cpu_model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu_model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu_model,
        "cores": str(os.cpu_count()),
        "torch": metadata.version("torch"),
        "nbgrader": metadata.version("nbgrader"),
        "python": platform.python_version(),
        # The grader isolates each notebook more strongly as root (namespaces, one uid per slot).
        "root": "yes" if os.geteuid() == 0 else "no",
        # On a shared machine other people's processes slow both graders down.
        "load average (1 min)": f"{os.getloadavg()[0]:.2f}",
    }


def wrong_answers(exercise_id: str) -> list[implementations.Variant]:
    """Every wrong answer in the fixtures (the `*_WRONG` lists) written for this exercise."""
    return [variant for name, variants in vars(implementations).items() if name.endswith("_WRONG")
            for variant in variants if variant.exercise == exercise_id]


def exercises_of(assignments: list[str]) -> list[exercises.Exercise]:
    return [exercise for exercise in exercises.EXERCISES.values() if exercise.assignment in assignments]


def draw_submission(rng: random.Random, student: str, exercise: exercises.Exercise) -> Submission:
    wrong = wrong_answers(exercise.id)
    kinds = [kind for kind in MIX if kind != "wrong" or wrong]
    kind = rng.choices(kinds, weights=[MIX[k] for k in kinds])[0]
    if kind == "wrong":
        kind = f"wrong:{rng.choice(wrong).name}"
    return Submission(student, exercise.assignment, exercise.id, kind)


def learner_answer(submission: Submission):
    if submission.kind == "solution":
        return learner_notebook(submission.exercise)
    if submission.kind == "release":
        return learner_notebook(submission.exercise, blank=True)
    name = submission.kind.removeprefix("wrong:")
    variant = next(v for v in wrong_answers(submission.exercise) if v.name == name)
    return learner_notebook(submission.exercise, variant.answers)


def write_class(submitted: Path, students: int, assignments: list[str], seed: int) -> list[Submission]:
    """`students` learners x every exercise of `assignments`, drawn from `seed`, in nbgrader's layout."""
    rng = random.Random(seed)
    submissions = [draw_submission(rng, f"student{index:03d}", exercise)
                   for index in range(1, students + 1) for exercise in exercises_of(assignments)]
    for submission in submissions:
        write(learner_answer(submission),
              submitted / submission.student / submission.assignment / f"{submission.exercise}.ipynb")
    return submissions


def run_checked(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    process = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}:\n{process.stderr[-3000:]}")


def grade_with_autograde(submitted: Path, out: Path, seed: int, jobs: int) -> tuple[float, dict]:
    """Wall seconds of `python -m autograde grade`, and its points by (student, exercise)."""
    start = time.perf_counter()
    run_checked([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
                 "--seed", str(seed), "--jobs", str(jobs)], cwd=ROOT)
    seconds = time.perf_counter() - start
    with open(out / "grades.csv", newline="") as grades:
        points = {(row["student"], row["exercise"]): float(row["score"]) for row in csv.DictReader(grades)}
    return seconds, points


def nbgrader_environment(seed: int) -> dict[str, str]:
    """nbgrader runs `alembic` by name, so this interpreter's scripts go first on PATH; its kernels
    import `autograde` from this repository and draw the hidden inputs from `seed`."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "AUTOGRADE_SEED": str(seed)}


def grade_with_nbgrader(submitted: Path, course: Path, assignments: list[str], seed: int,
                        submissions: list[Submission]) -> tuple[float, dict]:
    """Wall seconds of nbgrader's generate_assignment and autograde for every assignment, and its
    points by (student, exercise) from its gradebook (None where it recorded none)."""
    from nbgrader.api import Gradebook, MissingEntry  # imported here: --skip-nbgrader does without it

    for assignment in assignments:
        shutil.copytree(ROOT / "solutions" / assignment, course / "source" / assignment)
    shutil.copytree(submitted, course / "submitted")
    database = f"sqlite:///{course / 'gradebook.db'}"
    nbgrader = [sys.executable, "-m", "nbgrader"]
    common = [f"--CourseDirectory.root={course}", f"--db={database}"]
    env = nbgrader_environment(seed)
    start = time.perf_counter()
    for assignment in assignments:
        run_checked([*nbgrader, "generate_assignment", assignment, "--force", *common], cwd=course, env=env)
    for assignment in assignments:
        run_checked([*nbgrader, "autograde", assignment, "--force", f"--Execute.timeout={NBGRADER_CELL_SECONDS}",
                     *common], cwd=course, env=env)
    seconds = time.perf_counter() - start

    points = {}
    with Gradebook(database) as gradebook:
        for s in submissions:
            try:
                points[s.student, s.exercise] = gradebook.find_submission_notebook(
                    s.exercise, s.assignment, s.student).score
            except MissingEntry:
                points[s.student, s.exercise] = None
    return seconds, points


def points_side_by_side(submissions: list[Submission], ours: dict, theirs: dict) -> list[dict]:
    """Each (student, exercise) with what was handed in and both graders' points."""
    rows = []
    for s in submissions:
        mine, nbgrader = ours.get((s.student, s.exercise)), theirs.get((s.student, s.exercise))
        agree = mine is not None and nbgrader is not None and math.isclose(mine, nbgrader, abs_tol=1e-6)
        rows.append({"student": s.student, "exercise": s.exercise, "submission": s.kind,
                     "autograde": mine, "nbgrader": nbgrader, "agree": agree})
    return rows


def run_benchmark(students: int, assignments: list[str], jobs: int, seed: int, skip_nbgrader: bool,
                  folder: Path, nbgrader_students: int | None = None) -> dict:
    """Write the class under `folder`, grade it with the grader, then the first `nbgrader_students`
    (default: all) with both, and return the report (plain data)."""
    machine = machine_description()  # before grading: the load average is then other people's
    submitted = folder / "submitted"
    submissions = write_class(submitted, students, assignments, seed)
    notebooks = len(submissions)
    ours_seconds, ours = grade_with_autograde(submitted, folder / "grades", seed, jobs)
    subset_students = min(nbgrader_students or students, students)
    report = {
        "machine": machine,
        "students": students, "assignments": assignments, "notebooks": notebooks, "seed": seed, "jobs": jobs,
        "mix": {kind: sum(s.kind.split(":")[0] == kind for s in submissions) for kind in MIX},
        "autograde_seconds": ours_seconds, "autograde_seconds_per_notebook": ours_seconds / notebooks,
        "nbgrader_students": subset_students, "nbgrader_notebooks": None, "autograde_subset_seconds": None,
        "nbgrader_seconds": None, "nbgrader_seconds_per_notebook": None, "nbgrader_over_autograde": None,
        "grades": None, "disagreements": None,
    }
    if skip_nbgrader:
        return report
    subset, subset_seconds = submissions, ours_seconds
    if subset_students < students:
        names = sorted({s.student for s in submissions})[:subset_students]
        subset = [s for s in submissions if s.student in names]
        submitted = folder / "subset"
        for name in names:
            shutil.copytree(folder / "submitted" / name, submitted / name)
        subset_seconds, subset_points = grade_with_autograde(submitted, folder / "subset-grades", seed, jobs)
        if subset_points != {key: ours[key] for key in subset_points}:
            raise RuntimeError("the grader gave the subset other points than the whole class")
    nbgrader_seconds, theirs = grade_with_nbgrader(submitted, folder / "course", assignments, seed, subset)
    grades = points_side_by_side(subset, ours, theirs)
    report.update(nbgrader_notebooks=len(subset), autograde_subset_seconds=subset_seconds,
                  nbgrader_seconds=nbgrader_seconds, nbgrader_seconds_per_notebook=nbgrader_seconds / len(subset),
                  nbgrader_over_autograde=nbgrader_seconds / subset_seconds,
                  grades=grades, disagreements=[row for row in grades if not row["agree"]])
    return report


def markdown(report: dict) -> str:
    lines = [f"- {key}: {value}" for key, value in report["machine"].items()]
    lines += [
        f"- class: {report['students']} students x {', '.join(report['assignments'])} = {report['notebooks']} "
        f"notebooks ({', '.join(f'{count} {kind}' for kind, count in report['mix'].items())}), seed {report['seed']}",
        "",
        "| grader | seconds | seconds per notebook |",
        "|---|---:|---:|",
        f"| `python -m autograde grade --jobs {report['jobs']}` | {report['autograde_seconds']:.1f} "
        f"| {report['autograde_seconds_per_notebook']:.2f} |",
    ]
    if report["nbgrader_seconds"] is None:
        return "\n".join(lines + ["", "nbgrader: skipped"])
    found, subset = report["disagreements"], report["nbgrader_notebooks"]
    if subset < report["notebooks"]:
        lines.append(f"| the same, first {report['nbgrader_students']} students only | "
                     f"{report['autograde_subset_seconds']:.1f} | {report['autograde_subset_seconds'] / subset:.2f} |")
        compared = f"the first {report['nbgrader_students']} students"
    else:
        compared = "the whole class"
    lines += [
        f"| `nbgrader generate_assignment` + `autograde` (sequential), {compared} | {report['nbgrader_seconds']:.1f} "
        f"| {report['nbgrader_seconds_per_notebook']:.2f} |",
        "",
        f"nbgrader / autograde on {compared}: {report['nbgrader_over_autograde']:.2f}x",
        f"points that differ: {len(found)} of {subset} (student, exercise) pairs",
    ]
    lines += [f"  - {d['student']} {d['exercise']} ({d['submission']}): autograde {d['autograde']}, "
              f"nbgrader {d['nbgrader']}" for d in found[:SHOWN_DISAGREEMENTS]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=50, help="students in the class (default 50)")
    parser.add_argument("--assignment", action="append", choices=ASSIGNMENTS,
                        help="an assignment to hand in (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="the grader's notebooks at once (default: the number of cores)")
    parser.add_argument("--seed", type=int, default=12345, help="draws the class and the hidden tests' inputs")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--skip-nbgrader", action="store_true", help="time the grader alone")
    parser.add_argument("--nbgrader-students", type=int, metavar="K",
                        help="nbgrader (and the grader again) grade only the first K students (default: all)")
    args = parser.parse_args(argv)
    assignments = [a for a in ASSIGNMENTS if a in (args.assignment or ASSIGNMENTS)]

    with tempfile.TemporaryDirectory(prefix="grading-throughput-") as folder:
        report = run_benchmark(args.students, assignments, args.jobs, args.seed, args.skip_nbgrader, Path(folder),
                               args.nbgrader_students)
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
