"""Reports: the grade table (CSV), per-student feedback (Markdown), and text for one notebook."""

from __future__ import annotations

import csv
import html
import io
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from autograde.compare import CaseResult, total
from autograde.submission.forbidden import Violation
from autograde.submission.integrity import CHANGED, FOR_THE_LEARNER

if TYPE_CHECKING:
    from autograde.grading.grade import Grade

CSV_COLUMNS = ("student", "exercise", "score", "max_score", "status", "reason", "seed", "changed_from_release",
               "assignment", "assignment_score", "assignment_max_score", "total_score", "total_max_score")
RESULT_COLUMNS = ("student", "exercise", "test", "points", "max_points", "status", "visible", "message")
FOLDED_CASES_SHOWN = 3  # a parametrised test's failed cases named in a learner's feedback; the rest counted
INTEGRITY_COLUMNS = ("student", "exercise", "finding")
INTEGRITY_FILE = "integrity.csv"  # the instructor's: what changed from the release, one finding a row


def learner_notes(notes: tuple[str, ...] | list[str]) -> list[str]:
    """The notes a learner reads: the findings on the release's cells, which are the instructor's
    to weigh, as one plain sentence."""
    kept = [note for note in notes if not note.startswith(CHANGED)]
    return kept + [FOR_THE_LEARNER] if len(kept) < len(notes) else kept


def points(value: float) -> str:
    return f"{value:g}"


def counted(value: float) -> str:
    """`1 point`, `1.5 points`."""
    return f"{points(value)} point{'' if value == 1 else 's'}"


def case_lines(result: CaseResult, details: bool) -> list[str]:
    mark = "PASS" if result.passed else "FAIL" if result.ran else "NOT RUN"  # why: on the next lines
    name = result.name + ("" if result.visible else " (hidden)")
    lines = [f"{mark}  {name:<34} {points(result.earned):>4}/{points(result.points):<4} {result.about}"]
    if details and not result.passed:
        lines.append(f"      inputs: {result.inputs}")
        lines += [f"      {problem}" for problem in dict.fromkeys(result.problems)]  # a test's checks may repeat one
    return lines


def check_text(exercise_id: str, results: list[CaseResult], violations: list[Violation],
               hidden_points: float, elsewhere: list[Violation] = ()) -> str:
    """What `check(...)` prints in the notebook: each test, then the verdict the grader will give."""
    earned, possible = total(r.earned for r in results), total(r.points for r in results)
    lines = []
    for result in results:
        lines += case_lines(result, details=True)
    lines += [f"note: {violation.describe()} is outside the graded functions: not counted" for violation in elsewhere]
    if violations:
        lines += [f"NOT ALLOWED: {violation.describe()}" for violation in violations]
        lines.append(f'check("{exercise_id}"): the grader gives this exercise 0 points, whatever the tests '
                     f"(they would give {points(earned)} of {counted(possible)} from the visible tests)")
    else:
        lines.append(f'check("{exercise_id}"): {points(earned)} of {counted(possible)} from the visible tests'
                     + (f" (hidden tests add {points(hidden_points)} more at grading)" if hidden_points else ""))
    return "\n".join(lines)


def grade_text(grade: Grade, seed: int | None) -> str:
    """A report on one graded notebook, every test in detail (for the instructor's terminal)."""
    exercise = grade.exercise
    lines = [f"{exercise.id} ({exercise.notebook}, {exercise.title}): "
             f"{points(grade.score)} / {counted(grade.max_score)}, "
             f"status {grade.status}"] + ([f"hidden tests drawn with seed {seed}"] if seed is not None else [])
    if grade.reason:
        lines.append(f"reason: {grade.reason}")
    lines += [f"note: {note}" for note in grade.notes]
    for result in grade.results:
        lines += case_lines(result, details=True)
    return "\n".join(lines)


def write_atomically(path: Path, text: str) -> None:
    """Whole or not at all: written beside, flushed to disk, then renamed over."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", newline="", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    partial.replace(path)


def spreadsheet_text(text: str) -> str:
    """Text a spreadsheet shows as text: never read as a formula (=, +, -, @ first)."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _csv_text(header, rows) -> str:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(header)
    writer.writerows(rows)
    return text.getvalue()


def _totals(rows: list[tuple[str, Grade]]) -> tuple[dict, dict]:
    """(student, assignment) -> [score, max], and student -> [score, max]."""
    def add_up(key_of) -> dict:
        grades: dict = defaultdict(list)
        for student, grade in rows:
            grades[key_of(student, grade)].append(grade)
        return {key: [total(g.score for g in group), total(g.max_score for g in group)]
                for key, group in grades.items()}

    return add_up(lambda student, grade: (student, grade.exercise.assignment)), add_up(lambda student, _: student)


def write_csv(path: Path, rows: list[tuple[str, Grade]], seed: int) -> None:
    """One row per (student, exercise), with the totals of its assignment and of the student."""
    by_assignment, by_student = _totals(rows)
    lines = []
    for student, grade in rows:
        changed = "yes" if any(note.startswith(CHANGED) for note in grade.notes) else ""  # details: integrity.csv
        assignment = grade.exercise.assignment
        lines.append([spreadsheet_text(student), grade.exercise.id, points(grade.score), points(grade.max_score),
                      grade.status, spreadsheet_text(grade.reason), seed, changed,
                      assignment, *map(points, by_assignment[student, assignment]),
                      *map(points, by_student[student])])
    write_atomically(path, _csv_text(CSV_COLUMNS, lines))


def write_integrity_csv(path: Path, rows: list[tuple[str, Grade]]) -> None:
    """For the instructor alone: each notebook's departures from the release, one finding a row."""
    lines = [[spreadsheet_text(student), grade.exercise.id, spreadsheet_text(note.removeprefix(CHANGED))]
             for student, grade in rows for note in grade.notes if note.startswith(CHANGED)]
    write_atomically(path, _csv_text(INTEGRITY_COLUMNS, lines))


def result_status(grade: Grade, result: CaseResult) -> str:
    if not result.ran:
        return "not run"
    if not result.passed:
        return "failed"
    return "passed" if grade.counted else "passed, not counted"


def write_results_csv(path: Path, rows: list[tuple[str, Grade]]) -> None:
    """One row per (student, exercise, test): the long format, for a spreadsheet's pivot table."""
    lines = [[spreadsheet_text(student), grade.exercise.id, result.name,
              points(result.earned if grade.counted else 0), points(result.points), result_status(grade, result),
              "yes" if result.visible else "no", spreadsheet_text(failure_message(result))]
             for student, grade in rows for result in grade.results]
    write_atomically(path, _csv_text(RESULT_COLUMNS, lines))


def write_gradebooks(folder: Path, rows: list[tuple[str, Grade]]) -> None:
    """One row per student and a column per assignment, as Canvas and Moodle import them.

    Canvas's gradebook import reads the columns "Student", "ID", "SIS User ID", "SIS Login ID" and
    "Section" (one identifying column filled is enough: "SIS Login ID" here, the submission
    folder's name, nbgrader's student id), then one column per assignment, named by the
    assignment alone: a name ending in a number in parentheses would be read as the id of an
    existing Canvas assignment. The maximum of each is its "Points Possible" row, the first under
    the header. Moodle's "Import grades from CSV" maps an identifying column ("Username") to its
    users and each other column to a grade item. Both compute the course total themselves.
    """
    by_assignment, _ = _totals(rows)
    students = list(dict.fromkeys(student for student, _ in rows))
    assignments = list(dict.fromkeys(grade.exercise.assignment for _, grade in rows))
    maxima = {a: max((by_assignment[s, a][1] for s in students if (s, a) in by_assignment), default=0)
              for a in assignments}

    def scores(student: str) -> list[str]:
        return [points(by_assignment[student, a][0]) if (student, a) in by_assignment else "" for a in assignments]

    canvas = [["Points Possible", "", "", "", "", *(points(maxima[a]) for a in assignments)]]
    canvas += [[spreadsheet_text(s), "", "", spreadsheet_text(s), "", *scores(s)] for s in students]
    write_atomically(folder / "canvas.csv", _csv_text(
        ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *assignments], canvas))
    write_atomically(folder / "moodle.csv", _csv_text(
        ["Username", *assignments], [[spreadsheet_text(s), *scores(s)] for s in students]))


def failure_message(result: CaseResult) -> str:
    """What a failed test found, on one line: its first problem after the inputs line."""
    found = [problem for problem in result.problems if not problem.startswith("inputs: ")]
    return (found or list(result.problems) or [""])[0][:300]


def folded(results: tuple[CaseResult, ...] | list[CaseResult]) -> list[list[CaseResult]]:
    """The results grouped by test, a parametrised test's cases together, in order."""
    groups: dict[tuple[str, bool], list[CaseResult]] = {}
    for result in results:
        groups.setdefault((result.test, result.visible), []).append(result)
    return list(groups.values())


def _group_row(grade: Grade, cases: list[CaseResult]) -> str:
    """A feedback table's row for one test: its cases folded into one line, the failed ones named."""
    first = cases[0]
    name = first.test if len(cases) > 1 else first.name
    name += "" if first.visible else " (hidden)"
    earned = total(r.earned for r in cases) if grade.counted else 0
    failed = [r.case for r in cases if r.ran and not r.passed]
    not_run = sum(not r.ran for r in cases)
    if len(cases) == 1:
        outcome = result_status(grade, first)
    elif not failed and not_run in (0, len(cases)):
        outcome = f"{result_status(grade, first)} (all {len(cases)} cases)"
    else:
        shown = "; ".join(failed[:FOLDED_CASES_SHOWN]) + (f"; {len(failed) - FOLDED_CASES_SHOWN} more"
                                                         if len(failed) > FOLDED_CASES_SHOWN else "")
        outcome = ", ".join(filter(None, [f"{len(failed)} of {len(cases)} cases failed ({shown})" if failed else "",
                                          f"{not_run} of {len(cases)} not run" if not_run else ""]))
    return f"| {name} | {points(earned)} / {points(total(r.points for r in cases))} | {outcome} |"


def _markdown_problems(result: CaseResult) -> list[str]:
    return [f"**{result.name}**: {result.about}", "", f"- inputs: {result.inputs}",
            *(f"- {problem}" for problem in dict.fromkeys(result.problems)), ""]


def feedback_html(student: str, markdown: str) -> str:
    """The feedback page as HTML: the Markdown rendered with raw HTML escaped (submissions write
    some of its text)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>Feedback for {html.escape(student)}</title><style>body{{font-family:sans-serif;max-width:60em;"
            "margin:2em auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
            f"</style></head><body>\n{body}</body></html>\n")


def feedback_markdown(student: str, grades: list[Grade], seed: int) -> str:
    """Visible tests in detail; hidden tests by name and result only."""
    earned, possible = total(g.score for g in grades), total(g.max_score for g in grades)
    lines = [f"# Feedback for {student}", "",
             f"Total: {points(earned)} / {counted(possible)}. "
             "The hidden tests drew their inputs from the instructor's secret seed.", ""]
    for grade in grades:
        exercise = grade.exercise
        lines += [f"## {exercise.id}: {points(grade.score)} / {points(grade.max_score)}", "",
                  f"{exercise.title}, notebook `{exercise.notebook}`, status: {grade.status}.", ""]
        if grade.status != "graded":
            lines += [f"Reason: {grade.reason}.", ""]
        notes = learner_notes(grade.notes)
        lines += [f"- {note}" for note in notes] + ([""] if notes else [])
        lines += ["| Test | Points | Result |", "|---|---|---|"]
        lines += [_group_row(grade, cases) for cases in folded(grade.results)]
        lines.append("")
        failed = [r for r in grade.results if r.visible and not r.passed]
        if failed and grade.counted:
            lines += ["### What the failed visible tests found", ""]
            for result in failed:
                lines += _markdown_problems(result)
    return "\n".join(lines).rstrip() + "\n"
