"""Reports: the grade table (CSV), per-student feedback (Markdown), and text for one notebook."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

from autograde.grading.compare import CaseResult
from autograde.submission.forbidden import Violation
from autograde.submission.integrity import CHANGED

if TYPE_CHECKING:
    from autograde.grading.grade import Grade

CSV_COLUMNS = ("student", "exercise", "score", "max_score", "status", "reason", "seed", "changed_from_release")


def points(value: float) -> str:
    return f"{value:g}"


def case_lines(result: CaseResult, details: bool) -> list[str]:
    mark = "PASS" if result.passed else "FAIL"
    name = result.name + ("" if result.visible else " (hidden)")
    lines = [f"{mark}  {name:<34} {points(result.earned):>4}/{points(result.points):<4} {result.about}"]
    if details and not result.passed:
        lines.append(f"      inputs: {result.inputs}")
        lines += [f"      {problem}" for problem in result.problems]
    return lines


def check_text(exercise_id: str, results: list[CaseResult], violations: list[Violation],
               hidden_points: float, elsewhere: list[Violation] = ()) -> str:
    """What `check(...)` prints in the notebook: each test, then the verdict the grader will give."""
    earned, possible = sum(r.earned for r in results), sum(r.points for r in results)
    lines = []
    for result in results:
        lines += case_lines(result, details=True)
    lines += [f"note: {violation.describe()} is outside the graded functions: not counted" for violation in elsewhere]
    if violations:
        lines += [f"NOT ALLOWED: {violation.describe()}" for violation in violations]
        lines.append(f'check("{exercise_id}"): the grader gives this exercise 0 points, whatever the tests '
                     f"(they would give {points(earned)} of {points(possible)} visible points)")
    else:
        lines.append(f'check("{exercise_id}"): {points(earned)} of {points(possible)} points from the visible tests'
                     + (f" (hidden tests add {points(hidden_points)} more at grading)" if hidden_points else ""))
    return "\n".join(lines)


def grade_text(grade: Grade, seed: int | None) -> str:
    """A report on one graded notebook, every test in detail (for the instructor's terminal)."""
    exercise = grade.exercise
    lines = [f"{exercise.id} ({exercise.notebook}, {exercise.title}): "
             f"{points(grade.score)} / {points(grade.max_score)} points, "
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


def write_csv(path: Path, rows: list[tuple[str, Grade]], seed: int) -> None:
    """One row per (student, exercise)."""
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(CSV_COLUMNS)
    for student, grade in rows:
        changed = [note.removeprefix(CHANGED) for note in grade.notes if note.startswith(CHANGED)]
        writer.writerow([spreadsheet_text(student), grade.exercise.id, points(grade.score), points(grade.max_score),
                         grade.status, spreadsheet_text(grade.reason), seed, spreadsheet_text("; ".join(changed))])
    write_atomically(path, text.getvalue())


def _markdown_problems(result: CaseResult) -> list[str]:
    return [f"**{result.name}**: {result.about}", "", f"- inputs: {result.inputs}",
            *(f"- {problem}" for problem in result.problems), ""]


def feedback_markdown(student: str, grades: list[Grade], seed: int) -> str:
    """Visible tests in detail; hidden tests by name and result only."""
    total, possible = sum(g.score for g in grades), sum(g.max_score for g in grades)
    lines = [f"# Feedback for {student}", "",
             f"Total: {points(total)} / {points(possible)} points. "
             "The hidden tests drew their inputs from the instructor's secret seed.", ""]
    for grade in grades:
        exercise = grade.exercise
        lines += [f"## {exercise.id}: {points(grade.score)} / {points(grade.max_score)}", "",
                  f"{exercise.title}, notebook `{exercise.notebook}`, status: {grade.status}.", ""]
        if grade.status != "graded":
            lines += [f"Reason: {grade.reason}.", ""]
        lines += [f"- {note}" for note in grade.notes] + ([""] if grade.notes else [])
        lines += ["| Test | Points | Result |", "|---|---|---|"]
        for result in grade.results:
            name = result.name if result.visible else f"{result.name} (hidden)"
            outcome = ("passed" if grade.counted else "passed, not counted") if result.passed else "failed"
            earned = result.earned if grade.counted else 0
            lines.append(f"| {name} | {points(earned)} / {points(result.points)} | {outcome} |")
        lines.append("")
        failed = [r for r in grade.results if r.visible and not r.passed]
        if failed and grade.counted:
            lines += ["### What the failed visible tests found", ""]
            for result in failed:
                lines += _markdown_problems(result)
    return "\n".join(lines).rstrip() + "\n"
