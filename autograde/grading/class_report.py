"""The instructor's view of a graded class: one self-contained HTML page (`<out>/report.html`).

The notebooks that need a person (`ATTENTION`: review, not allowed, crashed, cut short, changed
from the release), the score distribution of each exercise and the statuses (matplotlib figures,
embedded), each student's row, the tests most notebooks fail (a parametrised test's cases
together) with their most common failure message, and the slowest notebooks (`SLOWEST_HEADING`:
the one part that differs between two gradings of the same class, since it shows measured times;
each grading process starts its sandbox before its first notebook, so no row holds that start).
It holds hidden tests' details: it is for the instructor, never for students.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from autograde.grading.report import failure_message, points
from autograde.submission.integrity import CHANGED

if TYPE_CHECKING:
    from autograde.grading.grade import Grade

MOST_FAILED, SLOWEST = 15, 10
BANDS = 10  # the score map's columns: tenths of an exercise's points
ATTENTION = ("review", "not allowed", "crashed", "incomplete")  # statuses a person should look at
SLOWEST_HEADING = "<h2>Slowest notebooks</h2>"


def _figure_tag(figure, alt: str) -> str:
    # Laid out already: "tight" bounds would draw it twice, and so would a layout engine left on it
    # (`tight_layout` leaves one), which saving runs in a draw of its own first.
    figure.set_layout_engine(None)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def plotting():
    """matplotlib's pyplot, drawing without a display (none where instructors grade)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warm_up() -> None:
    """What the report's first figure pays once, paid while the notebooks are graded (a run's
    `meanwhile`, `batch.grade_all`): pyplot's import, half a second, and a first small figure drawn
    and saved (its fonts and caches: the report's figures then take 0.31 s, not 0.49)."""
    plt = plotting()
    figure, axis = plt.subplots(figsize=(2, 1))
    axis.imshow([[0, 1]])
    axis.text(0, 0, "0")
    axis.set_title("warm-up")
    figure.tight_layout()
    _figure_tag(figure, "")
    plt.close(figure)


def _figures(rows: list[tuple[str, Grade]]) -> str:
    plt = plotting()
    by_exercise: dict[str, list[Grade]] = defaultdict(list)
    for _, grade in rows:
        by_exercise[grade.exercise.id].append(grade)
    exercises = list(by_exercise)
    # One map of the class, exercises by tenths of their points: one axes draws in a fifth of the time
    # of a histogram per exercise (0.14 against 0.6 s for twelve), and stays as wide for any number.
    counts = [[0] * BANDS for _ in exercises]
    for row, exercise in zip(counts, exercises):
        for grade in by_exercise[exercise]:
            row[min(BANDS - 1, int(BANDS * grade.score / (grade.max_score or 1)))] += 1
    figure, axis = plt.subplots(figsize=(6.4, 0.8 + 0.3 * len(exercises)))
    axis.imshow(counts, cmap="Blues", aspect="auto", vmin=0)
    axis.set_yticks(range(len(exercises)), exercises)
    width = 100 // BANDS
    axis.set_xticks(range(BANDS), [f"{width * band}-{width * (band + 1)}" for band in range(BANDS)])
    most = max(max(row) for row in counts)
    for y, row in enumerate(counts):
        for x, count in enumerate(row):
            if count:
                axis.text(x, y, str(count), ha="center", va="center", fontsize="small",
                          color="white" if count > most / 2 else "black")
    axis.set_xlabel("score, % of the exercise's points (100 in the last band)")
    axis.set_title("Students by score")
    figure.tight_layout()
    means = ", ".join(f"{e} {points(sum(g.score for g in by_exercise[e]) / len(by_exercise[e]))}" for e in exercises)
    scores = _figure_tag(figure, f"Students of each exercise by tenths of its points; mean scores: {means}")
    plt.close(figure)

    statuses = Counter((grade.exercise.id, grade.status) for _, grade in rows)
    names = sorted({status for _, status in statuses})
    figure, axis = plt.subplots(figsize=(max(4.0, 1.2 * len(exercises)), 2.8))
    bottom = [0] * len(exercises)
    for status in names:
        counts = [statuses[exercise, status] for exercise in exercises]
        axis.bar(exercises, counts, bottom=bottom, label=status)
        bottom = [b + c for b, c in zip(bottom, counts)]
    axis.set_ylabel("notebooks")
    axis.set_title("Notebooks by status")
    axis.legend(fontsize="small")
    figure.tight_layout()
    counted = "; ".join(f"{status}: {sum(statuses[e, status] for e in exercises)}" for status in names)
    status_figure = _figure_tag(figure, f"Stacked bars of the notebooks of each exercise by status; in all, {counted}")
    plt.close(figure)
    return scores + status_figure


def _table(header: list[str], lines: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in line) + "</tr>" for line in lines)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def most_failed(rows: list[tuple[str, Grade]]) -> list[list[str]]:
    """(exercise, test, notebooks failing it, their share of those that ran it, failed cases, the most
    common failure): a parametrised test's cases counted together, a notebook once per test."""
    ran: Counter = Counter()
    failing: Counter = Counter()
    cases: Counter = Counter()
    messages: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for _, grade in rows:
        ran.update({(grade.exercise.id, r.test) for r in grade.results if r.ran})
        failed = [r for r in grade.results if r.ran and not r.passed]
        failing.update({(grade.exercise.id, r.test) for r in failed})
        for result in failed:
            cases[grade.exercise.id, result.test] += 1
            messages[grade.exercise.id, result.test][failure_message(result)[:200]] += 1
    ranked = sorted(failing, key=lambda key: (-failing[key], key))[:MOST_FAILED]
    return [[exercise, test, str(failing[exercise, test]), f"{failing[exercise, test] / ran[exercise, test]:.0%}",
             str(cases[exercise, test]), messages[exercise, test].most_common(1)[0][0]] for exercise, test in ranked]


def needing_attention(rows: list[tuple[str, Grade]]) -> list[list[str]]:
    """(student, exercise, status, why) of each notebook a person should look at."""
    found = []
    for student, grade in rows:
        changed = any(note.startswith(CHANGED) for note in grade.notes)
        if grade.status in ATTENTION or changed:
            status = grade.status + (", changed from the release (integrity.csv)" if changed else "")
            found.append([student, grade.exercise.id, status, grade.reason[:300]])
    return found


def by_student(rows: list[tuple[str, Grade]], exercises: list[str]) -> list[list[str]]:
    """Each student's total and, per exercise, the score with any status but graded."""
    table = []
    for student in dict.fromkeys(student for student, _ in rows):
        grades = {g.exercise.id: g for s, g in rows if s == student}
        cells = [f"{points(g.score)}" + ("" if g.status == "graded" else f" ({g.status})") if g else ""
                 for g in (grades.get(e) for e in exercises)]
        table.append([student, points(sum(g.score for g in grades.values())), *cells])
    return table


def class_report_html(rows: list[tuple[str, Grade]], seed: int) -> str:
    students = list(dict.fromkeys(student for student, _ in rows))
    exercises = list(dict.fromkeys(grade.exercise.id for _, grade in rows))
    summary = []
    for exercise in exercises:
        grades = [g for _, g in rows if g.exercise.id == exercise]
        scores = sorted(g.score for g in grades)
        summary.append([exercise, str(len(grades)), points(sum(scores) / len(scores)), points(scores[len(scores) // 2]),
                        points(grades[0].max_score), str(sum(g.score == g.max_score for g in grades))])
    attention = needing_attention(rows)
    # Measured times: they differ between any two runs, a single one and merged shards alike.
    slowest = sorted(rows, key=lambda row: (-row[1].seconds, row[0], row[1].exercise.id))[:SLOWEST]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Class report</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left}img{max-width:100%}</style></head><body>",
        f"<h1>Class report</h1><p>{len(students)} students, {len(rows)} notebooks, hidden tests drawn with seed "
        f"{seed}. For the instructor only: it shows the hidden tests' failures.</p>",
        "<h2>Needs attention</h2>",
        _table(["student", "exercise", "status", "why"], attention) if attention
        else "<p>No notebook needs a person's look: none for review, not allowed, crashed, cut short or changed "
             "from the release.</p>",
        "<h2>Scores</h2>",
        _table(["exercise", "notebooks", "mean", "median", "max score", "full marks"], summary),
        rows and _figures(rows) or "",
        "<h2>Students</h2>",
        _table(["student", "total", *exercises], by_student(rows, exercises)),
        "<h2>Tests most often failed</h2>",
        _table(["exercise", "test", "notebooks failing it", "of those run", "cases failed", "most common failure"],
               most_failed(rows)),
        SLOWEST_HEADING,
        _table(["student", "exercise", "seconds", "status"],
               [[s, g.exercise.id, f"{g.seconds:.1f}", g.status] for s, g in slowest]),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
