"""`python -m autograde release | grade | merge | gradescope`: the instructor's commands."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path

from autograde import course, registry
from autograde.frontends import gradescope, release
from autograde.frontends.nbgrader import SEED_VARIABLE, choose_seed
from autograde.grading import batch, class_report, grade, journal, merge, provenance, report
from autograde.sandbox import cgroups, isolation
from autograde.sandbox import client as sandbox
from autograde.submission import notebook


def exercise_of(path: Path):
    """The exercise a lone notebook answers, from its file name (`sdpa.ipynb`, `sdpa (1).ipynb`)."""
    stem = path.stem.split(" ")[0]
    return registry.get(stem)


def grade_one(path: Path, seed: int, limits: sandbox.Limits) -> int:
    try:
        exercise = exercise_of(path)
    except KeyError as exc:
        print(f"{path.name}: {exc.args[0]}", file=sys.stderr)
        return 2
    result = grade.grade_notebook(path, exercise, seed, limits)
    print(report.grade_text(result, seed))
    return 0


def shard_argument(text: str) -> tuple[int, int]:
    try:
        return provenance.parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def write_outputs(out: Path, rows: list, seed: int, students: list[str]) -> str:
    """grades.csv, results.csv (one row per test), gradebooks for Canvas and Moodle, integrity.csv, the
    class report, and feedback per student in Markdown and HTML: the same for one run and for merged
    shards. Returns the line that names them."""
    print(f"writing the grades, the gradebooks, the class report and the feedback of "
          f"{plural(len(students), 'student')}", file=sys.stderr)
    report.write_csv(out / "grades.csv", rows, seed)
    report.write_results_csv(out / "results.csv", rows)
    report.write_gradebooks(out, rows)
    report.write_integrity_csv(out / report.INTEGRITY_FILE, rows)  # the instructor's, beside the grades
    report.write_atomically(out / "report.html", class_report.class_report_html(rows, seed))
    feedback = out / "feedback"
    feedback.mkdir(exist_ok=True)
    for student in students:
        grades = [g for s, g in rows if s == student]
        markdown = report.feedback_markdown(student, grades, seed)
        report.write_atomically(feedback / f"{student}.md", markdown)
        report.write_atomically(feedback / f"{student}.html", report.feedback_html(student, markdown))
    return (f"wrote {out}/: grades.csv, results.csv (a row per test), canvas.csv, moodle.csv, "
            f"{report.INTEGRITY_FILE} (the instructor's), report.html (the class), feedback/ (.md and .html "
            "per student)")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def grade_tree(submitted: Path, out: Path, seed: int | None, jobs: int, limits: sandbox.Limits,
               assignments: list[str] | None, resume: bool = False, shard: tuple[int, int] = (1, 1)) -> int:
    batch.stop_on_signals()  # Ctrl-C, SIGTERM, SIGHUP: what is recorded stays recorded, nothing else is
    record = None
    try:
        record = journal.Journal(out, seed, resume)
        rows = batch.grade_all(submitted, record.seed, jobs, limits, assignments, journal=record, shard=shard)
        students = list(dict.fromkeys(student for student, _ in rows))
        written = write_outputs(out, rows, record.seed, students)
    except journal.JournalError as exc:
        print(exc, file=sys.stderr)
        return 2
    except batch.Interrupted as exc:
        print(f"interrupted by {exc}: {len(record.done()) if record else 0} notebooks are recorded in "
              f"{out / journal.FILE}; grade the rest with --resume", file=sys.stderr)
        return 128 + exc.signum  # as a shell reports a command a signal ended
    finally:
        if record is not None:
            record.close()
    isolation = sorted({g.isolation for _, g in rows if g.isolation})
    part = "" if shard == (1, 1) else f" (shard {shard[0]}/{shard[1]}; merge the shards with `merge`)"
    print(f"graded {plural(len(rows), 'notebook')} of {plural(len(students), 'student')} with seed "
          f"{record.seed}{part}; {written}")
    unisolated = any(kind.startswith("session") for kind in isolation)
    print(f"isolation: {', '.join(isolation) or 'no notebook ran'}"
          + (f" ({sandbox.WEAKER_ISOLATION})" if unisolated else ""))
    return 0


def merge_shards(folders: list[Path], out: Path) -> int:
    try:
        metadata, rows = merge.merge(folders)
    except merge.MergeError as exc:
        print(f"cannot merge: {exc}", file=sys.stderr)
        return 2
    seed = int(metadata["seed"])
    record = journal.Journal(out, seed, resume=False)
    try:
        record.adopt(metadata)
        for student, notebook, row in rows:
            record.record(student, notebook, row)
    finally:
        record.close()
    students = list(dict.fromkeys(student for student, _, _ in rows))
    written = write_outputs(out, [(student, row) for student, _, row in rows], seed, students)
    print(f"merged {plural(len(folders), 'shard')}: {plural(len(rows), 'notebook')} of "
          f"{plural(len(students), 'student')} with seed {seed}; {written}")
    return 0


def isolation_allowed(unsafe_no_isolation: bool) -> bool:
    """Whether to grade here: the submissions can be isolated, or the instructor accepted that they
    cannot. Said once per run, loudly, when they cannot."""
    if sandbox.available_isolation() != "session":
        return True
    print(f"\n*** {sandbox.UNISOLATED}. {isolation.user_namespaces_refusal()}. ***",
          file=sys.stderr)
    if unsafe_no_isolation:
        print("*** Grading anyway (--unsafe-no-isolation): every grade's notes say so. ***\n", file=sys.stderr)
        return True
    print("*** Not grading. Run the grader as root, allow user namespaces, or pass --unsafe-no-isolation "
          "to grade trusted notebooks without isolation. ***\n", file=sys.stderr)
    return False


def delegated_cgroup_usable() -> bool:
    """`--delegated-cgroup`: whether the group this run started in can be divided, one group per
    notebook; where not, says why, loudly, and grading goes on without (the namespaces stand)."""
    if os.getuid() == 0:
        return True  # root makes its groups where it likes
    group, why = cgroups.delegated_cgroup(declared=True)
    if group is None:
        print(f"\n*** --delegated-cgroup: {why}. No notebook gets a cgroup of its own. ***\n", file=sys.stderr)
    return group is not None


GRADE_OUTPUTS = """\
what it writes in --out:
  grades.csv          one row per student and exercise: score, status, reason, the assignment's and
                      the student's totals
  results.csv         one row per test
  canvas.csv, moodle.csv   gradebooks to import
  integrity.csv       for you alone: how notebooks depart from the release (flagged in grades.csv)
  report.html         the class report: scores, the most failed tests, the slowest notebooks
  feedback/<student>.md, .html   each student's feedback: visible tests in detail, hidden ones by name
  journal.sqlite3     the run's record, for --resume

example:
  python -m autograde grade submitted/ --out grades/ --seed 12345 --assignment attention
  (submitted/<student>/<assignment>/<exercise>.ipynb, nbgrader's layout)
"""


def version() -> str:
    try:
        return importlib.metadata.version("mha-derived")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from the course's folder)"


def known_assignments() -> list[str]:
    return list(dict.fromkeys(exercise.assignment for exercise in registry.EXERCISES.values()))


def layout_problem(submitted: Path) -> str | None:
    """Why `submitted` is not a class's folder (`<student>/<assignment>/<exercise>.ipynb`), with a
    hint: it holds no notebook that deep, most often because it is one or two levels too deep."""
    def notebooks(pattern: str) -> list[Path]:
        return [p for p in submitted.glob(pattern) if not any(part.startswith(".") for part in
                                                                  p.relative_to(submitted).parts)]
    if notebooks("*/*/**/*.ipynb"):
        return None
    hint = "give the class's folder"
    if notebooks("*.ipynb"):
        hint = (f"it holds notebooks itself, as one student's assignment folder does: grade one with "
                f"`grade {submitted / notebooks('*.ipynb')[0].name}`, or {hint} ({submitted.parent.parent}?)")
    elif notebooks("*/*.ipynb"):
        hint = f"it looks like one student's folder: {hint} ({submitted.parent}?)"
    return f"{submitted} holds no notebook as <student>/<assignment>/<exercise>.ipynb: {hint}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograde", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    releasing = commands.add_parser("release", help="regenerate exercises/ from solutions/ with nbgrader")
    releasing.add_argument("--book-url", default=release.OPEN_BOOK,
                           help="the book the notebooks link to: your class edition's (default: the open "
                                "edition, %(default)s, which prints every answer)")
    releasing.add_argument("--repository", default=release.OPEN_REPOSITORY,
                           help="the repository the set-up cell clones on Colab and the Colab badge opens "
                                "(default: %(default)s)")
    grading = commands.add_parser(
        "grade", help="grade <submitted>/<student>/<assignment>/<exercise>.ipynb, or one notebook",
        epilog=GRADE_OUTPUTS, formatter_class=argparse.RawDescriptionHelpFormatter)
    grading.add_argument("path", type=Path, help="the submitted folder, or one notebook")
    grading.add_argument("--out", type=Path, default=Path("grades"),
                         help="where grades.csv and feedback/ go (default: grades)")
    grading.add_argument("--seed", type=int, help=f"seed of the hidden tests (default: ${SEED_VARIABLE}, "
                                                   "else a random one, written into the report)")
    grading.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                         help="notebooks graded at once (default: the number of cores)")
    grading.add_argument("--assignment", action="append",
                         help=f"grade only this assignment (repeatable; default: those submitted): "
                              f"{', '.join(known_assignments())}")
    grading.add_argument("--timeout", type=float, default=sandbox.Limits.wall_seconds,
                         help="wall-clock seconds for one notebook (default: %(default)s)")
    grading.add_argument("--shard", type=shard_argument, default=(1, 1), metavar="K/N",
                         help="grade only shard K of N of the students (a stable hash of each name); "
                              "merge the N output folders with `merge`")
    grading.add_argument("--resume", action="store_true",
                         help="go on with the run recorded in --out: grade only the notebooks not yet "
                              "recorded (or changed since), with the run's seed")
    grading.add_argument("--delegated-cgroup", action="store_true",
                         help="without root: the cgroup v2 group this run starts in is delegated to you "
                              "(systemd-run --user --scope -p Delegate=yes ...), so each notebook gets a "
                              "group of its own in it")
    grading.add_argument("--unsafe-no-isolation", action="store_true",
                         help="grade even where submissions cannot be isolated (no namespaces, no user "
                              "namespaces): they can then read what you can and reach the network")
    merging = commands.add_parser("merge", help="combine the --out folders of the shards of one class")
    merging.add_argument("shards", type=Path, nargs="+", help="the shards' --out folders")
    merging.add_argument("--out", type=Path, default=Path("grades"), help="where the merged grades go")
    gradescope.add_arguments(commands.add_parser(
        "gradescope", help="build a Gradescope autograder zip (see autograde/DEPLOYING.md)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    notebook.skip_iri_grammars()
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.command == "gradescope":
        return gradescope.run_from_args(args)

    if args.command == "merge":
        return merge_shards(args.shards, args.out)

    if args.command == "release":
        try:
            written = release.release(book_url=args.book_url, repository=args.repository)
        except (course.CourseNotFound, release.LinkError) as exc:
            print(exc, file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path.relative_to(course.root())}")
        return 0
    try:  # the references and the release: without them nothing can be graded
        course.solutions()
    except course.CourseNotFound as exc:
        print(exc, file=sys.stderr)
        return 2
    limits = sandbox.Limits(wall_seconds=args.timeout)
    if not args.path.exists():
        parser.error(f"{args.path} is neither a notebook nor a folder")
    unknown = [name for name in args.assignment or () if name not in known_assignments()]
    problem = (f"no assignment {', '.join(unknown)}; the assignments are {', '.join(known_assignments())}"
               if unknown else layout_problem(args.path) if args.path.is_dir() else None)
    if problem:  # before anything is written or started
        print(problem, file=sys.stderr)
        return 2
    if args.delegated_cgroup:
        delegated_cgroup_usable()
        sandbox.declare_delegated_cgroup()
    if not isolation_allowed(args.unsafe_no_isolation):
        return 2
    if args.path.is_file():
        return grade_one(args.path, choose_seed(args.seed), limits)
    if not args.path.is_dir():
        parser.error(f"{args.path} is neither a notebook nor a folder")
    resuming = args.resume and (args.out / journal.FILE).exists()
    if args.shard != (1, 1) and args.seed is None and not os.environ.get(SEED_VARIABLE) and not resuming:
        parser.error(f"the shards of a class must draw the same hidden tests: give --seed or set ${SEED_VARIABLE}")
    seed = args.seed if resuming else choose_seed(args.seed)
    return grade_tree(args.path, args.out, seed, args.jobs, limits, args.assignment, args.resume, args.shard)
