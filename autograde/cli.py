"""`python -m autograde release | grade`: the instructor's commands."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from autograde import exercises, grade, release, report, sandbox
from autograde.nbgrader_tests import SEED_VARIABLE


def choose_seed(given: int | None) -> int:
    if given is not None:
        return given
    if os.environ.get(SEED_VARIABLE):
        return int(os.environ[SEED_VARIABLE])
    return secrets.randbelow(2**32)


def exercise_of(path: Path):
    """The exercise a lone notebook answers, from its file name (`sdpa.ipynb`, `sdpa (1).ipynb`)."""
    stem = path.stem.split(" ")[0]
    return exercises.get(stem)


def grade_one(path: Path, seed: int, limits: sandbox.Limits) -> int:
    try:
        exercise = exercise_of(path)
    except KeyError as exc:
        print(f"{path.name}: {exc.args[0]}", file=sys.stderr)
        return 2
    result = grade.grade_notebook(path, grade.prepare(exercise, seed), limits)
    print(report.grade_text(result, seed))
    return 0


def grade_tree(submitted: Path, out: Path, seed: int, jobs: int, limits: sandbox.Limits,
               assignments: list[str] | None) -> int:
    rows = grade.grade_all(submitted, seed, jobs, limits, assignments)
    out.mkdir(parents=True, exist_ok=True)
    report.write_csv(out / "grades.csv", rows, seed)
    feedback = out / "feedback"
    feedback.mkdir(exist_ok=True)
    for student in grade.students_in(submitted):
        grades = [g for s, g in rows if s == student]
        (feedback / f"{student}.md").write_text(report.feedback_markdown(student, grades, seed))
    print(f"graded {len(rows)} notebooks of {len(grade.students_in(submitted))} students with seed {seed}: "
          f"{out / 'grades.csv'}, {feedback}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograde", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("release", help="regenerate exercises/ from solutions/ with nbgrader")
    grading = commands.add_parser(
        "grade", help="grade <submitted>/<student>/<assignment>/<exercise>.ipynb, or one notebook")
    grading.add_argument("path", type=Path, help="the submitted folder, or one notebook")
    grading.add_argument("--out", type=Path, default=Path("grades"),
                         help="where grades.csv and feedback/ go (default: grades)")
    grading.add_argument("--seed", type=int, help=f"seed of the hidden tests (default: ${SEED_VARIABLE}, "
                                                   "else a random one, written into the report)")
    grading.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                         help="notebooks graded at once (default: the number of cores)")
    grading.add_argument("--assignment", action="append",
                         help="grade only this assignment (repeatable; default: those submitted)")
    grading.add_argument("--timeout", type=float, default=sandbox.Limits.wall_seconds,
                         help="wall-clock seconds for one notebook (default: %(default)s)")
    args = parser.parse_args(argv)

    if args.command == "release":
        for path in release.release():
            print(f"wrote {path.relative_to(release.ROOT)}")
        return 0
    seed = choose_seed(args.seed)
    limits = sandbox.Limits(wall_seconds=args.timeout)
    if args.path.is_file():
        return grade_one(args.path, seed, limits)
    if not args.path.is_dir():
        parser.error(f"{args.path} is neither a notebook nor a folder")
    return grade_tree(args.path, args.out, seed, args.jobs, limits, args.assignment)
