"""The instructor's view of a graded class: one self-contained HTML page (`<out>/report.html`).

The notebooks that need a person (`ATTENTION`: review, not allowed, crashed, cut short, changed
from the release), the score distribution of each exercise and the statuses (tables drawn as
charts by the browser), each student's row, the tests most notebooks fail (a parametrised test's cases
together) with their most common failure message, and the slowest notebooks (`SLOWEST_HEADING`:
the one part that differs between two gradings of the same class, since it shows measured times;
each grading process starts its sandbox before its first notebook, so no row holds that start).
It holds hidden tests' details: it is for the instructor, never for students.
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from autograde.grading.report import failure_message, points
from autograde.submission.integrity import CHANGED

if TYPE_CHECKING:
    from autograde.grading.grade import Grade

MOST_FAILED, SLOWEST = 15, 10
BANDS = 10  # the score map's columns: tenths of an exercise's points
ATTENTION = ("review", "not allowed", "crashed", "incomplete")  # statuses a person should look at
# The status bars' colours, in their order (`grade.py`'s statuses); another status is drawn grey, last.
STATUS_COLOURS = {"graded": "#2ca02c", "incomplete": "#ff7f0e", "review": "#1f77b4", "not allowed": "#d62728",
                  "crashed": "#9467bd", "invalid": "#8c564b", "missing": "#7f7f7f"}
OTHER_COLOUR = "#bcbd22"
SLOWEST_HEADING = "<h2>Slowest notebooks</h2>"


def _shade(share: float) -> str:
    """A blue from pale (a share near 0) to dark (1): the score map's cells by their count."""
    pale, dark = (222, 235, 247), (8, 81, 156)
    return "#" + "".join(f"{round(p + (d - p) * share):02x}" for p, d in zip(pale, dark))


def _score_map(by_exercise: dict[str, list[Grade]]) -> str:
    """The class in one table: each exercise's notebooks by tenths of its points, the counts shaded."""
    counts = {exercise: [0] * BANDS for exercise in by_exercise}
    for exercise, grades in by_exercise.items():
        for grade in grades:
            counts[exercise][min(BANDS - 1, int(BANDS * grade.score / (grade.max_score or 1)))] += 1
    most = max(max(row) for row in counts.values())
    width = 100 // BANDS
    head = "".join(f"<th>{width * band}–{width * (band + 1)}</th>" for band in range(BANDS))
    lines = []
    for exercise, row in counts.items():
        cells = "".join(f'<td style="background:{_shade(count / most)};color:{"#fff" if count > most / 2 else "#000"}">'
                        f"{count}</td>" if count else "<td></td>" for count in row)
        lines.append(f"<tr><th>{html.escape(exercise)}</th>{cells}</tr>")
    caption = "Students by score: each exercise's notebooks by the share of its points they scored, in % (full " \
              "marks in the last band)"
    return (f'<table class="chart scores"><caption>{caption}</caption><thead><tr><th>exercise</th>{head}</tr>'
            f"</thead><tbody>{''.join(lines)}</tbody></table>")


def _status_bars(by_exercise: dict[str, list[Grade]]) -> str:
    """Each exercise's notebooks by status: the counts, and a bar of them to the scale of the largest."""
    exercises = list(by_exercise)
    statuses = Counter((exercise, grade.status) for exercise, grades in by_exercise.items() for grade in grades)
    present = {name for _, name in statuses}
    names = [name for name in STATUS_COLOURS if name in present] + sorted(present - STATUS_COLOURS.keys())
    colours = {name: STATUS_COLOURS.get(name, OTHER_COLOUR) for name in names}
    longest = max(sum(statuses[e, name] for name in names) for e in exercises)
    lines = []
    for exercise in exercises:
        counts = [statuses[exercise, name] for name in names]
        bar = "".join(f'<span style="width:{100 * count / longest:.2f}%;background:{colours[name]}" '
                      f'title="{html.escape(name)}: {count}"></span>' for name, count in zip(names, counts) if count)
        cells = "".join(f"<td>{count or ''}</td>" for count in counts)
        lines.append(f'<tr><th>{html.escape(exercise)}</th>{cells}<td class="bar"><div>{bar}</div></td></tr>')
    head = "".join(f'<th><span class="key" style="background:{colours[name]}"></span>{html.escape(name)}</th>'
                   for name in names)
    return (f'<table class="chart statuses"><caption>Notebooks by status</caption><thead><tr><th>exercise</th>'
            f"{head}<th>notebooks</th></tr></thead><tbody>{''.join(lines)}</tbody></table>")


def _charts(by_exercise: dict[str, list[Grade]]) -> str:
    """The score map and the status bars: tables a browser draws (and a screen reader reads), not images,
    so that a run draws nothing (matplotlib's import and two figures took 0.6 CPU s, 3.5% of grading
    48 notebooks on 2 cores, and the run's last step waited for the figures)."""
    return _score_map(by_exercise) + _status_bars(by_exercise)


def _by_exercise(rows: list[tuple[str, Grade]]) -> dict[str, list[Grade]]:
    """The grades of each exercise, the exercises in the rows' order."""
    grouped: dict[str, list[Grade]] = defaultdict(list)
    for _, grade in rows:
        grouped[grade.exercise.id].append(grade)
    return grouped


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
    by_exercise = _by_exercise(rows)
    exercises = list(by_exercise)
    summary = []
    for exercise, grades in by_exercise.items():
        scores = sorted(g.score for g in grades)
        mean = round(sum(scores) / len(scores), 2)  # 3.08, not 3.08333
        summary.append([exercise, str(len(grades)), points(mean), points(scores[len(scores) // 2]),
                        points(grades[0].max_score), str(sum(g.score == g.max_score for g in grades))])
    attention = needing_attention(rows)
    # Measured times: they differ between any two runs, a single one and merged shards alike.
    slowest = sorted(rows, key=lambda row: (-row[1].seconds, row[0], row[1].exercise.id))[:SLOWEST]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Class report</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left}caption{text-align:left;font-weight:bold;"
        "padding:.5em 0}table.chart{margin:1em 0}table.scores td{text-align:center;min-width:2.5em}"
        ".bar div{display:flex;width:20em;height:1em}.bar span{display:block;height:100%}"
        ".key{display:inline-block;width:.8em;height:.8em;margin-right:.3em}</style></head><body>",
        f"<h1>Class report</h1><p>{len(students)} students, {len(rows)} notebooks, hidden tests drawn with seed "
        f"{seed}. For the instructor only: it shows the hidden tests' failures.</p>",
        "<h2>Needs attention</h2>",
        _table(["student", "exercise", "status", "why"], attention) if attention
        else "<p>No notebook needs a person's look: none for review, not allowed, crashed, cut short or changed "
             "from the release.</p>",
        "<h2>Scores</h2>",
        _table(["exercise", "notebooks", "mean", "median", "max score", "full marks"], summary),
        rows and _charts(by_exercise) or "",
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
