"""The instructor's view of a graded class: one self-contained HTML page (`<out>/report.html`).

The score distribution of each exercise and the statuses (matplotlib figures, embedded), the
tests most students fail with their most common failure message, and the slowest notebooks
(`SLOWEST_HEADING`: the one part that differs between two gradings of the same class, since it
shows measured times). It holds hidden tests' details: it is for the instructor, never for students.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from autograde.grading.report import points

if TYPE_CHECKING:
    from autograde.grading.grade import Grade

MOST_FAILED, SLOWEST = 15, 10
SLOWEST_HEADING = "<h2>Slowest notebooks</h2>"


def _figure_tag(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="figure" src="data:image/png;base64,{encoded}">'


def _figures(rows: list[tuple[str, Grade]]) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display where instructors grade
    import matplotlib.pyplot as plt

    by_exercise: dict[str, list[Grade]] = defaultdict(list)
    for _, grade in rows:
        by_exercise[grade.exercise.id].append(grade)
    exercises = list(by_exercise)
    figure, axes = plt.subplots(1, len(exercises), figsize=(3 * len(exercises), 2.6), squeeze=False)
    for axis, exercise in zip(axes[0], exercises):
        grades = by_exercise[exercise]
        top = max(g.max_score for g in grades) or 1
        axis.hist([g.score for g in grades], bins=[top * i / 10 for i in range(11)], color="tab:blue")
        axis.set_title(exercise)
        axis.set_xlabel("score")
    axes[0][0].set_ylabel("students")
    figure.tight_layout()
    scores = _figure_tag(figure)
    plt.close(figure)

    statuses = Counter((grade.exercise.id, grade.status) for _, grade in rows)
    names = sorted({status for _, status in statuses})
    figure, axis = plt.subplots(figsize=(max(4.0, 1.2 * len(exercises)), 2.6))
    bottom = [0] * len(exercises)
    for status in names:
        counts = [statuses[exercise, status] for exercise in exercises]
        axis.bar(exercises, counts, bottom=bottom, label=status)
        bottom = [b + c for b, c in zip(bottom, counts)]
    axis.set_ylabel("notebooks")
    axis.legend(fontsize="small")
    figure.tight_layout()
    status_figure = _figure_tag(figure)
    plt.close(figure)
    return scores + status_figure


def _table(header: list[str], lines: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in line) + "</tr>" for line in lines)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def most_failed(rows: list[tuple[str, Grade]]) -> list[list[str]]:
    """(exercise, test, failures, share of the notebooks that ran it, most common first problem)."""
    ran: Counter = Counter()
    failures: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for _, grade in rows:
        for result in grade.results:
            if result.ran:
                ran[grade.exercise.id, result.name] += 1
                if not result.passed:
                    failures[grade.exercise.id, result.name][result.problems[0][:200]] += 1
    ranked = sorted(failures, key=lambda key: (-sum(failures[key].values()), key))[:MOST_FAILED]
    return [[exercise, test, str(sum(failures[exercise, test].values())),
             f"{sum(failures[exercise, test].values()) / ran[exercise, test]:.0%}",
             failures[exercise, test].most_common(1)[0][0]] for exercise, test in ranked]


def class_report_html(rows: list[tuple[str, Grade]], seed: int) -> str:
    students = list(dict.fromkeys(student for student, _ in rows))
    exercises = list(dict.fromkeys(grade.exercise.id for _, grade in rows))
    summary = []
    for exercise in exercises:
        grades = [g for _, g in rows if g.exercise.id == exercise]
        scores = sorted(g.score for g in grades)
        summary.append([exercise, str(len(grades)), points(sum(scores) / len(scores)), points(scores[len(scores) // 2]),
                        points(grades[0].max_score), str(sum(g.score == g.max_score for g in grades))])
    # Measured times: they differ between any two runs, a single one and merged shards alike.
    slowest = sorted(rows, key=lambda row: (-row[1].seconds, row[0], row[1].exercise.id))[:SLOWEST]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Class report</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left}img{max-width:100%}</style></head><body>",
        f"<h1>Class report</h1><p>{len(students)} students, {len(rows)} notebooks, hidden tests drawn with seed "
        f"{seed}. For the instructor only: it shows the hidden tests' failures.</p>",
        "<h2>Scores</h2>",
        _table(["exercise", "notebooks", "mean", "median", "max score", "full marks"], summary),
        rows and _figures(rows) or "",
        "<h2>Tests most often failed</h2>",
        _table(["exercise", "test", "failed", "of those run", "most common failure"], most_failed(rows)),
        SLOWEST_HEADING,
        _table(["student", "exercise", "seconds", "status"],
               [[s, g.exercise.id, f"{g.seconds:.1f}", g.status] for s, g in slowest]),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
