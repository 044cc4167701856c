"""Grading a class: `python -m autograde grade` against `nbgrader autograde`, same notebooks, same machine.

    python -m benchmarks.grading_throughput                       # 50 students, every assignment
    python -m benchmarks.grading_throughput --students 2 --assignment attention   # a smoke run
    python -m benchmarks.grading_throughput --students 500 --nbgrader-students 5 --scaling   # a large class

It writes a synthetic class in a temporary folder, in nbgrader's layout
`submitted/<student>/<assignment>/<exercise>.ipynb`: every student hands in every exercise of
the chosen assignments, each notebook drawn from the seed out of a realistic mix (the reference
answers, the untouched release, or a partly done one: the solution with its last graded cell left
as released). Then, one after the other in the same run, it times

1. the course's grader, `python -m autograde grade <submitted> --seed S --jobs N`;
2. nbgrader as a course runs it: `generate_assignment`, then `autograde --force` (its default,
   one notebook after the other), for each assignment, with `AUTOGRADE_SEED=S` so that its
   hidden tests draw the same inputs;
3. the grader again on the notebooks nbgrader graded, so that the grader's runs bracket
   nbgrader's minutes: the ratio is nbgrader's time over the mean of the grader's two, and a
   machine whose speed drifts during the run (a shared one's can move by a third within an hour)
   moves it less than it moves a ratio to one run timed before. Both runs must give the same
   points.

With `--nbgrader-students K`, nbgrader grades only the first K students (it takes about 20 times
longer per notebook), and the grader grades them again on their own, so that the ratio compares
the same notebooks, timed one after the other in the same run. No ratio is extrapolated from them
to the class: nbgrader's time per notebook falls as the class grows (its steps per assignment,
`generate_assignment` and each `autograde` command's start, are shared by more notebooks), so its
time on K students spread over the class would overstate it.

It prints the machine, the wall time of each and per notebook, nbgrader's time over the
grader's on the same notebooks, and the (student, exercise) pairs where the two give different
points: the test cells and the grader run the same tests, so any disagreement is a bug in one
of them, and the command then exits 1. `--json PATH` also writes the numbers and every pair's points.

Wall times depend on what else the machine runs; CPU times (of every process each grader started,
from `wait4`) much less, so both are printed, and ratios are taken in one run. `--scaling`
grades the class with `--jobs 1` too. `--per-exercise N` (default 2; 0: not) measures, for each
exercise, the seconds of one solution notebook on one core: the grader, pinned to one core, grades
1 + N solution notebooks of the exercise in one run, which records each notebook's time; the
median of all but the first is a notebook's own cost, the first's is what a grading process pays
once more (the visible tests' references, collecting the tests). (A difference of two runs' CPU
seconds, as it was measured before, carried each run's start-up noise: a second of it over N.)
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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import nbformat

from autograde import registry as exercises
from autograde.grading.journal import Journal

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = tuple(dict.fromkeys(exercise.assignment for exercise in exercises.EXERCISES.values()))
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


def solution_cell_ids(notebook: nbformat.NotebookNode) -> list[str]:
    return [cell.metadata["nbgrader"]["grade_id"] for cell in notebook.cells
            if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)]


def wrong_answers(exercise_id: str) -> list[str]:
    """The partly done answers of an exercise: its last graded cell left as released (none with one cell)."""
    cells = solution_cell_ids(nbformat.read(ROOT / "solutions" / exercises.get(exercise_id).notebook, as_version=4))
    return [f"{cells[-1]} left as released"] if len(cells) > 1 else []


def exercises_of(assignments: list[str]) -> list[exercises.Exercise]:
    return [exercise for exercise in exercises.EXERCISES.values() if exercise.assignment in assignments]


def draw_submission(rng: random.Random, student: str, exercise: exercises.Exercise) -> Submission:
    wrong = wrong_answers(exercise.id)
    kinds = [kind for kind in MIX if kind != "wrong" or wrong]
    kind = rng.choices(kinds, weights=[MIX[k] for k in kinds])[0]
    if kind == "wrong":
        kind = f"wrong:{rng.choice(wrong)}"
    return Submission(student, exercise.assignment, exercise.id, kind)


def learner_notebook(submission: Submission) -> nbformat.NotebookNode:
    """The released notebook with the solution's answers in all its graded cells (a solution), all but
    the last (partly done), or none (the release)."""
    exercise = exercises.get(submission.exercise)
    notebook = nbformat.read(ROOT / "exercises" / exercise.notebook, as_version=4)
    solution = nbformat.read(ROOT / "solutions" / exercise.notebook, as_version=4)
    answers = {cell.metadata["nbgrader"]["grade_id"]: cell.source for cell in solution.cells
               if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)}
    cells = solution_cell_ids(notebook)
    answered = {"solution": cells, "release": []}.get(submission.kind, cells[:-1])
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") in answered:
            cell.source = answers[cell.metadata["nbgrader"]["grade_id"]]
    return notebook


def write(notebook: nbformat.NotebookNode, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    return path


def write_class(submitted: Path, students: int, assignments: list[str], seed: int) -> list[Submission]:
    """`students` learners x every exercise of `assignments`, drawn from `seed`, in nbgrader's layout."""
    rng = random.Random(seed)
    submissions = [draw_submission(rng, f"student{index:03d}", exercise)
                   for index in range(1, students + 1) for exercise in exercises_of(assignments)]
    for submission in submissions:
        write(learner_notebook(submission),
              submitted / submission.student / submission.assignment / f"{submission.exercise}.ipynb")
    return submissions


def run_checked(command: list[str], cwd: Path, env: dict[str, str] | None = None,
                cores: set[int] | None = None) -> float:
    """Run `command`; the CPU seconds of it and every process it started and waited for (`wait4`: its
    own, whatever else this process runs). `cores`: pinned to these cores, with everything it starts."""
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            output.seek(0)
            tail = output.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(command)} exited {process.returncode}:\n{tail}")
    return usage.ru_utime + usage.ru_stime


def grade_with_autograde(submitted: Path, out: Path, seed: int, jobs: int,
                         cores: set[int] | None = None) -> tuple[float, float, dict]:
    """Wall and CPU seconds of `python -m autograde grade`, and its points by (student, exercise).
    `cores`: pinned to these, with as many threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))} if cores else None
    start = time.perf_counter()
    cpu = run_checked([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
                       "--seed", str(seed), "--jobs", str(jobs)], cwd=ROOT, env=env, cores=cores)
    seconds = time.perf_counter() - start
    with open(out / "grades.csv", newline="") as grades:
        points = {(row["student"], row["exercise"]): float(row["score"]) for row in csv.DictReader(grades)}
    return seconds, cpu, points


def per_exercise_seconds(exercise: exercises.Exercise, notebooks: int, seed: int, folder: Path) -> dict:
    """Seconds of one solution notebook of `exercise` on one core: the grader, pinned to one core with
    one thread (torch's threads pinned to one core would spin waiting for each other), grades 1 +
    `notebooks` solution notebooks of it in one run, which records each notebook's time (from its
    file to its grade). The first pays what a grading process pays once (collecting the tests, the
    visible tests' references, the first calls); the median of the others is what one more costs.
    On one core the grading process and the learner's worker take turns, so these are the CPU
    seconds of both, give or take what else the machine ran on that core."""
    core = {min(os.sched_getaffinity(0))}
    submissions = [Submission(f"student{index:03d}", exercise.assignment, exercise.id, "solution")
                   for index in range(1, notebooks + 2)]
    for submission in submissions:
        write(learner_notebook(submission), folder / "class" / submission.student /
              submission.assignment / f"{submission.exercise}.ipynb")
    _, cpu, points = grade_with_autograde(folder / "class", folder / "grades", seed, 1, core)
    recorded = Journal(folder / "grades", None, resume=True).grades()
    first, *others = [recorded[submission.student, exercise.id].seconds for submission in submissions]
    return {"exercise": exercise.id, "notebooks": notebooks, "first_notebook_seconds": first,
            "seconds_per_notebook": statistics.median(others), "run_cpu_seconds": cpu,
            # the other exercises of the assignment are graded too, as missing: they cost next to nothing
            "scores": sorted({score for (_, graded), score in points.items() if graded == exercise.id})}


def nbgrader_environment(seed: int) -> dict[str, str]:
    """nbgrader runs `alembic` by name, so this interpreter's scripts go first on PATH; its kernels
    import `autograde` from this repository and draw the hidden inputs from `seed`."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "AUTOGRADE_SEED": str(seed)}


def grade_with_nbgrader(submitted: Path, course: Path, assignments: list[str], seed: int,
                        submissions: list[Submission]) -> tuple[float, float, dict]:
    """Wall and CPU seconds of nbgrader's generate_assignment and autograde for every assignment, and
    its points by (student, exercise) from its gradebook (None where it recorded none)."""
    from nbgrader.api import Gradebook, MissingEntry  # imported here: --skip-nbgrader does without it

    for assignment in assignments:
        shutil.copytree(ROOT / "solutions" / assignment, course / "source" / assignment)
    shutil.copytree(submitted, course / "submitted")
    database = f"sqlite:///{course / 'gradebook.db'}"
    nbgrader = [sys.executable, "-m", "nbgrader"]
    common = [f"--CourseDirectory.root={course}", f"--db={database}"]
    env = nbgrader_environment(seed)
    start, cpu = time.perf_counter(), 0.0
    for assignment in assignments:
        cpu += run_checked([*nbgrader, "generate_assignment", assignment, "--force", *common], cwd=course, env=env)
    for assignment in assignments:
        cpu += run_checked([*nbgrader, "autograde", assignment, "--force",
                            f"--Execute.timeout={NBGRADER_CELL_SECONDS}", *common], cwd=course, env=env)
    seconds = time.perf_counter() - start

    points = {}
    with Gradebook(database) as gradebook:
        for s in submissions:
            try:
                points[s.student, s.exercise] = gradebook.find_submission_notebook(
                    s.exercise, s.assignment, s.student).score
            except MissingEntry:
                points[s.student, s.exercise] = None
    return seconds, cpu, points


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
                  folder: Path, nbgrader_students: int | None = None, scaling: bool = False,
                  per_exercise: int = 0) -> dict:
    """Write the class under `folder`, grade it with the grader (also with `--jobs 1` if `scaling`),
    then the first `nbgrader_students` (default: all) with both, and with the grader once more after
    nbgrader; with `per_exercise` N, each exercise's
    cost per solution notebook on one core from N + 1 notebooks. Returns the report (plain data)."""
    machine = machine_description()  # before grading: the load average is then other people's
    submitted = folder / "submitted"
    submissions = write_class(submitted, students, assignments, seed)
    notebooks = len(submissions)
    ours_seconds, ours_cpu, ours = grade_with_autograde(submitted, folder / "grades", seed, jobs)
    subset_students = min(nbgrader_students or students, students)
    report = {
        "machine": machine,
        "students": students, "assignments": assignments, "notebooks": notebooks, "seed": seed, "jobs": jobs,
        "mix": {kind: sum(s.kind.split(":")[0] == kind for s in submissions) for kind in MIX},
        "autograde_seconds": ours_seconds, "autograde_seconds_per_notebook": ours_seconds / notebooks,
        "autograde_cpu_seconds": ours_cpu, "scaling": None, "scaling_points_that_differ": None, "per_exercise": None,
        "nbgrader_students": subset_students, "nbgrader_notebooks": None, "autograde_subset_seconds": None,
        "autograde_subset_cpu_seconds": None, "autograde_after_seconds": None, "autograde_after_cpu_seconds": None,
        "nbgrader_seconds": None, "nbgrader_cpu_seconds": None,
        "nbgrader_seconds_per_notebook": None, "nbgrader_over_autograde": None, "nbgrader_over_autograde_cpu": None,
        "grades": None, "disagreements": None,
    }
    if scaling and jobs != 1:
        one_seconds, one_cpu, one = grade_with_autograde(submitted, folder / "grades-1-job", seed, 1)
        report["scaling"] = [{"jobs": 1, "seconds": one_seconds, "cpu_seconds": one_cpu},
                             {"jobs": jobs, "seconds": ours_seconds, "cpu_seconds": ours_cpu}]
        # Equal unless a notebook ran into a time limit on a busy machine: said, not hidden.
        report["scaling_points_that_differ"] = sorted(f"{student} {exercise}: {one.get((student, exercise))} "
                                                      f"with --jobs 1, {points} with --jobs {jobs}"
                                                      for (student, exercise), points in ours.items()
                                                      if one.get((student, exercise)) != points)
    if per_exercise:
        report["per_exercise"] = [per_exercise_seconds(exercise, per_exercise, seed,
                                                       folder / "per-exercise" / exercise.id)
                                  for exercise in exercises_of(assignments)]
    if skip_nbgrader:
        return report
    subset, subset_seconds, subset_cpu, subset_points = submissions, ours_seconds, ours_cpu, ours
    if subset_students < students:
        names = sorted({s.student for s in submissions})[:subset_students]
        subset = [s for s in submissions if s.student in names]
        submitted = folder / "subset"
        for name in names:
            shutil.copytree(folder / "submitted" / name, submitted / name)
        subset_seconds, subset_cpu, subset_points = grade_with_autograde(submitted, folder / "subset-grades", seed,
                                                                         jobs)
        if subset_points != {key: ours[key] for key in subset_points}:
            raise RuntimeError("the grader gave the subset other points than the whole class")
    nbgrader_seconds, nbgrader_cpu, theirs = grade_with_nbgrader(submitted, folder / "course", assignments, seed,
                                                                 subset)
    after_seconds, after_cpu, after_points = grade_with_autograde(submitted, folder / "grades-after", seed, jobs)
    if after_points != subset_points:
        raise RuntimeError("the grader gave other points after nbgrader than before it")
    compared_seconds, compared_cpu = (subset_seconds + after_seconds) / 2, (subset_cpu + after_cpu) / 2
    grades = points_side_by_side(subset, ours, theirs)
    report.update(nbgrader_notebooks=len(subset), autograde_subset_seconds=subset_seconds,
                  autograde_subset_cpu_seconds=subset_cpu, autograde_after_seconds=after_seconds,
                  autograde_after_cpu_seconds=after_cpu, nbgrader_seconds=nbgrader_seconds,
                  nbgrader_cpu_seconds=nbgrader_cpu, nbgrader_seconds_per_notebook=nbgrader_seconds / len(subset),
                  nbgrader_over_autograde=nbgrader_seconds / compared_seconds,
                  nbgrader_over_autograde_cpu=nbgrader_cpu / compared_cpu,
                  grades=grades, disagreements=[row for row in grades if not row["agree"]])
    return report


def markdown(report: dict) -> str:
    lines = [f"- {key}: {value}" for key, value in report["machine"].items()]
    lines += [
        f"- class: {report['students']} students x {', '.join(report['assignments'])} = {report['notebooks']} "
        f"notebooks ({', '.join(f'{count} {kind}' for kind, count in report['mix'].items())}), seed {report['seed']}",
        "",
        "| grader | seconds | seconds per notebook | CPU seconds |",
        "|---|---:|---:|---:|",
        f"| `python -m autograde grade --jobs {report['jobs']}` | {report['autograde_seconds']:.1f} "
        f"| {report['autograde_seconds_per_notebook']:.2f} | {report['autograde_cpu_seconds']:.1f} |",
    ]
    if report["nbgrader_seconds"] is None:
        lines += ["", "nbgrader: skipped"]
    else:
        found, subset = report["disagreements"], report["nbgrader_notebooks"]
        if subset < report["notebooks"]:
            lines.append(f"| the same, first {report['nbgrader_students']} students only | "
                         f"{report['autograde_subset_seconds']:.1f} "
                         f"| {report['autograde_subset_seconds'] / subset:.2f} "
                         f"| {report['autograde_subset_cpu_seconds']:.1f} |")
            compared = f"the first {report['nbgrader_students']} students"
        else:
            compared = "the whole class"
        lines += [
            f"| `nbgrader generate_assignment` + `autograde` (sequential), {compared} | "
            f"{report['nbgrader_seconds']:.1f} | {report['nbgrader_seconds_per_notebook']:.2f} "
            f"| {report['nbgrader_cpu_seconds']:.1f} |",
            f"| the grader again after nbgrader, {compared} | {report['autograde_after_seconds']:.1f} "
            f"| {report['autograde_after_seconds'] / subset:.2f} | {report['autograde_after_cpu_seconds']:.1f} |",
            "",
            f"nbgrader / autograde on {compared}, the grader's two runs' mean: "
            f"{report['nbgrader_over_autograde']:.2f}x (CPU seconds: {report['nbgrader_over_autograde_cpu']:.2f}x)",
            f"points that differ: {len(found)} of {subset} (student, exercise) pairs",
        ]
        lines += [f"  - {d['student']} {d['exercise']} ({d['submission']}): autograde {d['autograde']}, "
                  f"nbgrader {d['nbgrader']}" for d in found[:SHOWN_DISAGREEMENTS]]
    if report["scaling"]:
        one = report["scaling"][0]["seconds"]
        lines += ["", "| --jobs | seconds | notebooks per minute | speed-up | CPU seconds |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {row['jobs']} | {row['seconds']:.1f} | {60 * report['notebooks'] / row['seconds']:.1f} "
                  f"| {one / row['seconds']:.2f}x | {row['cpu_seconds']:.1f} |" for row in report["scaling"]]
        lines += [f"points that differ between --jobs 1 and {report['jobs']}: {difference}"
                  for difference in report["scaling_points_that_differ"]]
    if report["per_exercise"]:
        lines += ["", "| exercise | seconds per solution notebook, one core (median) | seconds of the first "
                  "notebook | CPU seconds of the run (start-up included) | points |", "|---|---:|---:|---:|---|"]
        lines += [f"| {row['exercise']} | {row['seconds_per_notebook']:.2f} | {row['first_notebook_seconds']:.2f} "
                  f"| {row['run_cpu_seconds']:.2f} | {', '.join(f'{p:g}' for p in row['scores'])} |"
                  for row in report["per_exercise"]]
    return "\n".join(lines)


def summary_values(report: dict) -> dict[str, float]:
    """The report's numbers as name=value lines, for scripts."""
    values = {"notebooks": report["notebooks"], "autograde_seconds": report["autograde_seconds"],
              "autograde_seconds_per_notebook": report["autograde_seconds_per_notebook"],
              "autograde_cpu_seconds_per_notebook": report["autograde_cpu_seconds"] / report["notebooks"]}
    if report["nbgrader_seconds"] is not None:
        values.update(nbgrader_seconds_per_notebook=report["nbgrader_seconds_per_notebook"],
                      nbgrader_over_autograde=report["nbgrader_over_autograde"],
                      nbgrader_over_autograde_cpu=report["nbgrader_over_autograde_cpu"],
                      points_that_differ=len(report["disagreements"]))
    for row in report["scaling"] or []:
        values[f"seconds_jobs_{row['jobs']}"] = row["seconds"]
    for row in report["per_exercise"] or []:
        values[f"seconds_per_notebook_{row['exercise']}"] = row["seconds_per_notebook"]
    return values


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
    parser.add_argument("--scaling", action="store_true", help="grade the class with --jobs 1 as well")
    parser.add_argument("--per-exercise", type=int, default=2, metavar="N",
                        help="seconds per solution notebook of each exercise on one core, from N + 1 notebooks "
                             "(default 2; 0: not measured)")
    args = parser.parse_args(argv)
    assignments = [a for a in ASSIGNMENTS if a in (args.assignment or ASSIGNMENTS)]

    with tempfile.TemporaryDirectory(prefix="grading-throughput-") as folder:
        report = run_benchmark(args.students, assignments, args.jobs, args.seed, args.skip_nbgrader, Path(folder),
                               args.nbgrader_students, args.scaling, args.per_exercise)
    print(markdown(report))
    print()
    for name, value in summary_values(report).items():
        print(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
