"""The grader on Gradescope: the autograder zip, and the grading inside Gradescope's container.

    python -m autograde.frontends.gradescope build --out autograder.zip [--seed N] [--assignment A ...]

writes the zip to upload as a Gradescope programming assignment's autograder: `setup.sh` and
`run_autograder` at its top, the `autograde` package, the solution notebooks of the chosen
assignments (the references come from their solution cells) and their released notebooks
(submissions are checked against them), the pinned requirements and `gradescope.json` with
the instructor's seed. For each submission, `run_autograder` calls

    python -m autograde.frontends.gradescope grade --root /autograder

which finds the exercise notebooks among the uploaded files by name, grades them with the
same sandboxed pipeline as `python -m autograde grade` (`grade.grade_notebook`), the hidden
inputs drawn for the submitter (their Gradescope ids, keyed by the seed)
and writes `results/results.json` in Gradescope's format
(https://gradescope-autograders.readthedocs.io/en/latest/specs/): visible tests in detail at
once, hidden tests by name and result once the instructor publishes the grades. How to deploy
it: DEPLOYING.md.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import stat
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from autograde.sandbox import client as sandbox

if __name__ == "__main__" and sys.argv[1:2] == ["grade"]:
    sandbox.start_zygote()  # the fork server's imports beside this process's, not after them

from autograde.frontends.nbgrader import SEED_VARIABLE, choose_seed  # noqa: E402
from autograde.grading import grade, report  # noqa: E402
from autograde.registry import EXERCISES  # noqa: E402
from autograde.submission import notebook  # noqa: E402
from autograde.submission.locate import Found, find_all  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1]  # autograde/
COURSE = PACKAGE.parent  # the course's folder; in the container, /autograder/source
TEMPLATES = Path(__file__).resolve().parent / "gradescope_files"  # copied to the top of the zip
EXECUTABLES = ("setup.sh", "run_autograder")
CONFIG = "gradescope.json"
# The references come from the solution cells; submissions are checked against the release.
NOTEBOOK_FOLDERS = ("solutions", "exercises")
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so that the same course and seed give the same zip
# What students often leave around their notebooks: never graded, never reported.
NOTE_CHARS = 600  # of one note in the summary
MAX_NOTES = 8  # per exercise, in the summary


# Building the zip.

def chosen_assignments(assignments: list[str] | None) -> list[str]:
    """The assignments to grade, in the course's order; all of them by default."""
    known = list(dict.fromkeys(exercise.assignment for exercise in EXERCISES.values()))
    if not assignments:
        return known
    unknown = sorted(set(assignments) - set(known))
    if unknown:
        raise ValueError(f"unknown assignment(s): {', '.join(unknown)}; the assignments are {', '.join(known)}")
    return [name for name in known if name in assignments]


def package_files() -> list[Path]:
    """The `autograde` package as the course has it, without caches and without these templates."""
    return sorted(
        path for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and TEMPLATES not in path.parents
    )


def _entry(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_TIME)
    info.create_system = 3  # Unix, so that unzip applies the mode
    info.external_attr = (stat.S_IFREG | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def build(out: Path, seed: int, assignments: list[str] | None) -> Path:
    """Write the autograder zip to `out` for the chosen assignments (default: all) and seed."""
    chosen = chosen_assignments(assignments)
    files = [(path.name, path, 0o755 if path.name in EXECUTABLES else 0o644) for path in sorted(TEMPLATES.iterdir())]
    files += [(path.relative_to(COURSE).as_posix(), path, 0o644) for path in package_files()]
    files += [(f"{folder}/{exercise.notebook}", COURSE / folder / exercise.notebook, 0o644)
              for folder in NOTEBOOK_FOLDERS for exercise in EXERCISES.values() if exercise.assignment in chosen]
    config = json.dumps({"seed": seed, "assignments": chosen}, indent=2) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as archive:
        for name, path, mode in files:
            archive.writestr(_entry(name, mode), path.read_bytes())
        archive.writestr(_entry(CONFIG, 0o600), config)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("autograder.zip"),
                        help="where the zip goes (default: %(default)s)")
    parser.add_argument("--seed", type=int, help=f"seed of the hidden tests (default: ${SEED_VARIABLE}, "
                                                   "else a random one, printed)")
    parser.add_argument("--assignment", action="extend", nargs="+", metavar="A",
                        help="grade only these assignments (default: all of them)")


def run_from_args(args: argparse.Namespace) -> int:
    seed = choose_seed(args.seed)
    try:
        path = build(args.out, seed, args.assignment)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    chosen = ", ".join(chosen_assignments(args.assignment))
    print(f"wrote {path} for {chosen}; hidden tests drawn with seed {seed} "
          "(keep it private, and build with it again to regrade with the same tests)")
    return 0


def private_copy(path: Path, folder: Path) -> Path:
    """A copy of the notebook that only this process can read or change, taken before any
    submitted code runs; the file itself is opened without following links."""
    copy = folder / str(len(list(folder.iterdir()))) / path.name
    copy.parent.mkdir()
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as source:
        with copy.open("wb") as target:  # as much as the grader reads, and one byte to refuse a larger one
            remaining = notebook.READ_BYTES + 1
            while remaining and (block := source.read(min(remaining, 2**20))):
                target.write(block)
                remaining -= len(block)
    return copy


# Gradescope's results.json.

def _clip(text: str) -> str:
    return text if len(text) <= NOTE_CHARS else text[:NOTE_CHARS] + " [...]"


def reason(graded: grade.Grade, found: Found) -> str:
    return found.note if graded.status == grade.MISSING else graded.reason


def case_entries(number: int, graded: grade.Grade, found: Found) -> list[dict]:
    """One Gradescope test per test case: visible ones in detail, hidden ones by result only."""
    entries = []
    for index, result in enumerate(graded.results, 1):
        passed = result.passed and graded.counted
        if not graded.counted:
            output = f"0 points: {graded.status}: {reason(graded, found)}"
        elif not result.visible:
            output = f"hidden test {'passed' if passed else 'failed'}"
        elif passed:
            output = result.about
        else:
            output = "\n".join([result.about, f"inputs: {result.inputs}", *result.problems])
        entries.append({
            "name": f"{graded.exercise.id}: {result.name}" + ("" if result.visible else " (hidden)"),
            "number": f"{number}.{index}",
            "score": result.earned if graded.counted else 0.0,
            "max_score": result.points,
            "status": "passed" if passed else "failed",
            "output": output,
            "visibility": "visible" if result.visible else "after_published",
        })
    return entries


def summary(graded: grade.Grade, found: Found) -> list[str]:
    """What the learner sees at once about one exercise: nothing from the hidden tests."""
    exercise = graded.exercise
    visible = [r for r in graded.results if r.visible]
    hidden_points = sum(r.points for r in graded.results if not r.visible)
    if graded.counted:
        earned = sum(r.earned for r in visible)
        line = (f"{exercise.id} ({exercise.title}): visible tests {report.points(earned)} / "
                f"{report.points(sum(r.points for r in visible))} points; hidden tests "
                f"({report.points(hidden_points)} points) when the grades are published")
        if graded.status != grade.GRADED:
            line += f"; {graded.status}: {graded.reason}"
    else:
        line = f"{exercise.id} ({exercise.title}): 0 / {report.points(graded.max_score)} points, {graded.status}: " \
               f"{reason(graded, found)}"
    notes = ([found.note] if found.path is not None else []) + report.learner_notes(graded.notes)
    if len(notes) > MAX_NOTES:
        notes = notes[:MAX_NOTES - 1] + [f"and {len(notes) - MAX_NOTES + 1} more notes"]
    return [line] + [f"  - {_clip(note)}" for note in notes]


def results_json(grades: list[tuple[grade.Grade, Found]], notes: list[str], seconds: float) -> dict:
    tests = [entry for number, (graded, found) in enumerate(grades, 1) for entry in case_entries(number, graded, found)]
    lines = [line for graded, found in grades for line in summary(graded, found)] + notes
    return {
        "score": sum(test["score"] for test in tests),
        "execution_time": round(seconds),
        "output": html.escape("\n".join(lines), quote=False),  # rendered as HTML (simple_format)
        "tests": tests,
    }


def submitter(root: Path) -> str:
    """Who submitted, for the hidden tests' seed: the Gradescope ids of the submission's users
    (`submission_metadata.json`, written by Gradescope before anything of the submission runs)."""
    try:
        users = json.loads((root / "submission_metadata.json").read_text())["users"]
        return ",".join(sorted(str(user["id"]) for user in users))
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def grade_submission(root: Path) -> dict:
    """Grade `<root>/submission` with the seed and assignments of the zip; write and return the results."""
    started = time.monotonic()
    config = json.loads((COURSE / CONFIG).read_text())
    seed, exercises = config["seed"], [e for e in EXERCISES.values() if e.assignment in config["assignments"]]
    print(f"grading {root / 'submission'} with the course in {COURSE}: {', '.join(config['assignments'])}")
    found, notes = find_all(exercises, root / "submission")
    who = submitter(root)
    grades = []
    with tempfile.TemporaryDirectory(prefix="gradescope-") as folder:
        private = Path(folder)
        # Every notebook copied before the first one runs; a missing one gets a path that surely
        # does not exist, never one that a link in the submission could fill.
        paths = [private_copy(f.path, private) if f.path else private / "missing" / f"{e.id}.ipynb"
                 for e, f in zip(exercises, found)]
        for exercise, f, path in zip(exercises, found, paths):
            graded = grade.grade_notebook(path, exercise, seed, submitter=who)
            print(f"\n{f.note}\n{report.grade_text(graded, None)}", flush=True)
            grades.append((graded, f))
    results = results_json(grades, notes, time.monotonic() - started)
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    isolation = sorted({g.isolation for g, _ in grades if g.isolation})
    print(f"\n{report.points(results['score'])} points; wrote {out}; isolation: {', '.join(isolation) or 'none ran'}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograde.frontends.gradescope",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_arguments(commands.add_parser("build", help="write the autograder zip to upload on Gradescope"))
    grading = commands.add_parser("grade", help="grade a submission inside Gradescope's container")
    grading.add_argument("--root", type=Path, default=Path(os.environ.get("AUTOGRADER_ROOT", "/autograder")),
                         help="Gradescope's folder: submission/ in, results/results.json out "
                              "(default: $AUTOGRADER_ROOT, else /autograder)")
    args = parser.parse_args(argv)
    if args.command == "build":
        return run_from_args(args)
    grade_submission(args.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
