"""`python -m autograde grade`, over a class and on one notebook, as an instructor runs it."""

from __future__ import annotations

import collections
import csv
import importlib.metadata
import re
import shutil
from pathlib import Path

import pytest

from autograde import course
from autograde.compare import CaseResult
from autograde.frontends import cli
from autograde.grading import batch, class_report, report
from autograde.grading.grade import Grade
from autograde.registry import EXERCISES
from tests.conftest import CLASS_EXPECTED
from tests.fixtures.notebooks import ROOT, SEED
from tests.site_support import CHROMIUM_ARGS, ensure_chromium

ARTIFACTS = ROOT / "test-artifacts"

pytestmark = [pytest.mark.xdist_group("autograde_cli"), pytest.mark.timeout(600)]


def test_grading_a_class_exits_0_and_writes_one_row_per_student_and_exercise(class_grades):
    assert class_grades.returncode == 0, class_grades.stderr
    assert list(class_grades.rows[0]) == ["student", "exercise", "score", "max_score", "status", "reason", "seed",
                                          "changed_from_release", "assignment", "assignment_score",
                                          "assignment_max_score", "total_score", "total_max_score"]
    pairs = [(r["student"], r["exercise"]) for r in class_grades.rows]
    assert sorted(pairs) == sorted((s, e) for s in CLASS_EXPECTED for e in ("sdpa", "mha"))
    assert {r["max_score"] for r in class_grades.rows} == {"10"}
    assert {r["seed"] for r in class_grades.rows} == {str(SEED)}
    assert f"seed {SEED}" in class_grades.stdout


def test_the_progress_bar_says_what_it_waits_for_and_the_last_line_names_every_output(class_grades):
    """The bar shows at once, saying what the start waits for, then the time left, without tqdm's
    doubled separator; the minutes after 100% are named; the summary names each file it wrote."""
    progress = class_grades.stderr  # read as text: each of tqdm's "\r" is a line
    frames = [line for line in progress.splitlines() if "%|" in line]
    assert batch.STARTING in frames[0], progress[:300]
    assert "left]" in progress and ", ," not in progress, progress
    assert batch.STOPPING in progress and "writing the grades" in progress
    summary = next(line for line in class_grades.stdout.splitlines() if line.startswith("graded "))
    students = len(CLASS_EXPECTED)
    assert summary.startswith(f"graded {2 * students} notebooks of {students} students with seed {SEED}; "
                              f"wrote {class_grades.out}/: ")
    written = {path.name for path in class_grades.out.iterdir()} - {"journal.sqlite3"}
    assert written == {"grades.csv", "results.csv", "canvas.csv", "moodle.csv", report.INTEGRITY_FILE,
                       "report.html", "feedback"}
    assert all(name in summary for name in written), summary


@pytest.mark.parametrize("student", sorted(CLASS_EXPECTED))
def test_each_student_gets_the_expected_score_and_status(class_grades, student):
    for exercise, (score, status) in CLASS_EXPECTED[student].items():
        row = class_grades.row(student, exercise)
        assert (float(row["score"]), row["status"]) == (score, status), row


def test_reasons_say_what_went_wrong(class_grades):
    reason = {(r["student"], r["exercise"]): r["reason"] for r in class_grades.rows}
    assert reason["ada", "sdpa"] == ""
    assert "failed: causal-mask-rectangular, causal-mask-random" in reason["cleo", "sdpa"]
    assert "not valid JSON" in reason["dan", "sdpa"]
    assert "no attention/mha.ipynb was submitted" in reason["dan", "mha"]
    assert "empty (0 bytes)" in reason["eve", "sdpa"]
    assert "uses torch.nn.MultiheadAttention.forward" in reason["eve", "mha"]


def test_each_row_carries_its_assignments_and_its_students_totals(class_grades):
    for student, expected in CLASS_EXPECTED.items():
        total = sum(score for score, _ in expected.values())
        for exercise in expected:
            row = class_grades.row(student, exercise)
            assert row["assignment"] == "attention"
            assert float(row["assignment_score"]) == float(row["total_score"]) == total
            assert row["assignment_max_score"] == row["total_max_score"] == "20"


def test_one_row_per_test_in_the_long_format_adds_up_to_the_grades(class_grades):
    results = list(csv.DictReader((class_grades.out / "results.csv").open()))
    assert list(results[0]) == ["student", "exercise", "test", "points", "max_points", "status", "visible", "message"]
    for row in class_grades.rows:
        tests = [r for r in results if (r["student"], r["exercise"]) == (row["student"], row["exercise"])]
        assert tests and sum(float(t["points"]) for t in tests) == pytest.approx(float(row["score"]))
        assert sum(float(t["max_points"]) for t in tests) == pytest.approx(float(row["max_score"]))
    statuses = {r["status"] for r in results if (r["student"], r["exercise"]) == ("dan", "mha")}
    assert statuses == {"not run"}  # a missing notebook's tests did not fail: they never ran
    assert " | not run |" in (class_grades.out / "feedback" / "dan.md").read_text()
    assert {r["status"] for r in results if r["student"] == "ada"} == {"passed"}
    failed = {r["test"]: r for r in results if (r["student"], r["exercise"], r["status"]) == ("cleo", "sdpa", "failed")}
    assert failed["causal-mask-rectangular"]["visible"] == "yes" and failed["causal-mask-random"]["visible"] == "no"
    assert failed["causal-mask-rectangular"]["message"].startswith("`causal_mask(3, 6)`: 9 of 18 entries differ")
    assert {r["message"] for r in results if r["status"] == "passed"} == {""}


def test_gradebooks_for_canvas_and_moodle_have_a_row_per_student_and_a_column_per_assignment(class_grades):
    canvas = list(csv.reader((class_grades.out / "canvas.csv").open()))
    # Canvas's documented import: the five identifying columns in this order, an assignment's column
    # named by it alone (not "name (number)", which is an existing assignment's id), points in row 2.
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "attention"]
    assert not any(re.search(r"\(\d+\)$", name) for name in canvas[0])
    assert canvas[1][0] == "Points Possible" and canvas[1][-1] == "20"
    moodle = list(csv.DictReader((class_grades.out / "moodle.csv").open()))
    assert [r["Username"] for r in moodle] == sorted(CLASS_EXPECTED) == [r[3] for r in canvas[2:]]
    for row, line in zip(moodle, canvas[2:]):
        expected = sum(score for score, _ in CLASS_EXPECTED[row["Username"]].values())
        assert float(row["attention"]) == float(line[-1]) == expected


def test_feedback_details_visible_tests_and_names_hidden_ones_only(class_grades):
    feedback = (class_grades.out / "feedback" / "cleo.md").read_text()
    assert "## sdpa: 8.5 / 10" in feedback
    assert "| causal-mask-rectangular | 0 / 1 | failed |" in feedback
    assert "`causal_mask(3, 6)`: 9 of 18 entries differ, first at index (0, 1): expected True, got False" in feedback
    assert "| causal-mask-random (hidden) | 0 / 0.5 | failed |" in feedback
    assert "causal_mask(L, S) is bottom-right aligned" in feedback
    hidden_details = [line for line in feedback.splitlines() if "causal-mask-random" in line]
    assert hidden_details == ["| causal-mask-random (hidden) | 0 / 0.5 | failed |"]
    feedback = sorted(p.name for p in (class_grades.out / "feedback").iterdir())
    assert feedback == sorted(f"{s}.{kind}" for s in CLASS_EXPECTED for kind in ("md", "html"))


def test_feedback_in_html_is_the_markdown_rendered_with_what_submissions_wrote_escaped(class_grades):
    page = (class_grades.out / "feedback" / "cleo.html").read_text()
    hidden = next(r["test"] for r in csv.DictReader((class_grades.out / "results.csv").open())
                  if (r["student"], r["exercise"], r["status"]) == ("cleo", "sdpa", "failed")
                  and f"| {r['test']} (hidden) |" in (class_grades.out / "feedback" / "cleo.md").read_text())
    assert "<h2>sdpa: 8.5 / 10</h2>" in page and f"<td>{hidden} (hidden)</td>" in page
    hostile = report.feedback_html("<b>x</b>", "a problem: <script>alert(1)</script>")
    assert "<script>" not in hostile and "&lt;script&gt;" in hostile and "<b>x</b>" not in hostile


def _chart_rows(page: str, kind: str) -> dict[str, list[str]]:
    """A chart table of report.html (`scores` or `statuses`): its cells' texts by the row's exercise."""
    table = page.split(f'<table class="chart {kind}">')[1].split("</table>")[0]
    body = table.split("<tbody>")[1]
    return {re.search(r"<th>(.*?)</th>", row).group(1): re.findall(r"<td[^>]*>(.*?)</td>", row)
            for row in body.split("</tr>") if "<th>" in row}


def test_the_class_report_shows_scores_failures_and_the_slowest_notebooks(class_grades):
    page = (class_grades.out / "report.html").read_text()
    for heading in ("Needs attention", "Scores", "Students", "Tests most often failed", "Slowest notebooks"):
        assert f"<h2>{heading}</h2>" in page
    attention = page.split("<h2>Needs attention</h2>")[1].split("<h2>")[0]
    assert "<td>eve</td><td>mha</td><td>not allowed</td>" in attention
    assert "<td>fay</td><td>mha</td><td>not allowed</td>" in attention and "<td>ada</td>" not in attention
    mean = round(sum(expected["mha"][0] for expected in CLASS_EXPECTED.values()) / len(CLASS_EXPECTED), 2)
    assert f"<tr><td>mha</td><td>{len(CLASS_EXPECTED)}</td><td>{mean:g}</td>" in page  # to the hundredth
    students = page.split("<h2>Students</h2>")[1].split("<h2>")[0]
    assert "<tr><td>cleo</td><td>17</td><td>8.5</td><td>8.5</td></tr>" in students
    assert "<tr><td>dan</td><td>0</td><td>0 (invalid)</td><td>0 (missing)</td></tr>" in students
    failed = {r["test"] for r in csv.DictReader((class_grades.out / "results.csv").open()) if r["status"] == "failed"}
    assert any(f"<td>{test}</td>" in page for test in failed)
    assert f"seed {SEED}" in page


def test_the_class_reports_charts_count_every_notebook_in_its_band_and_status(class_grades):
    """The score map: each exercise's notebooks in the tenth of its points they scored (full marks in
    the last); the status bars: each exercise's notebooks by status, as grades.csv has them."""
    page = (class_grades.out / "report.html").read_text()
    scores, statuses = _chart_rows(page, "scores"), _chart_rows(page, "statuses")
    for exercise in ("sdpa", "mha"):
        rows = [r for r in class_grades.rows if r["exercise"] == exercise]
        bands = [0] * class_report.BANDS
        for row in rows:
            bands[min(class_report.BANDS - 1, int(class_report.BANDS * float(row["score"]) / 10))] += 1
        assert [int(cell or 0) for cell in scores[exercise]] == bands
        names = re.findall(r'<span class="key"[^>]*></span>(.*?)</th>', page)
        counted = {name: int(cell or 0) for name, cell in zip(names, statuses[exercise])}
        assert {name: count for name, count in counted.items() if count} == dict(
            collections.Counter(row["status"] for row in rows))
    assert "<img" not in page  # drawn by the browser: the run draws no figure


def test_the_charts_shade_by_count_and_draw_an_unknown_status_too():
    """The darkest cell is the most common band; a status the report has no colour for still has its
    column and bar; a name is escaped."""
    exercise = EXERCISES["sdpa"]

    def grade(score: float, status: str) -> Grade:  # out of 10, the second case failed
        return Grade(exercise, status, "", (CaseResult("right", score, True, "", "", ()),
                                            CaseResult("wrong", 10 - score, True, "", "", ("wrong",))))

    rows = [("a", grade(10, "graded")), ("b", grade(10, "graded")), ("c", grade(2.5, "graded")),
            ("d", grade(0, "<odd>"))]
    charts = class_report._charts(class_report._by_exercise(rows))
    cells = re.findall(r'<td style="background:(#[0-9a-f]{6});color:(#[0-9a-f]{3})">(\d+)</td>', charts)
    assert [count for _, _, count in cells] == ["1", "1", "2"]  # bands 0, 2 and 9
    assert cells[-1][:2] == (class_report._shade(1.0), "#fff") and cells[0][1] == "#000"
    assert "&lt;odd&gt;" in charts and "<odd>" not in charts
    assert f"background:{class_report.OTHER_COLOUR}" in charts
    bars = re.findall(r'<span style="width:([0-9.]+)%;background:(#[0-9a-f]{6})" title="([^"]*)"></span>', charts)
    assert [(float(width), title) for width, _, title in bars] == [(75.0, "graded: 3"), (25.0, "&lt;odd&gt;: 1")]


def test_the_class_report_reads_in_a_real_browser(class_grades):
    """report.html in Chromium: no error, both charts laid out (the score map's cells, each status
    bar as long as its share), the sections in order; a screenshot for a person to look at goes to
    test-artifacts/."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(ensure_chromium()), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda message: message.type == "error" and errors.append(message.text))
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto((class_grades.out / "report.html").as_uri(), wait_until="load")
        charts = page.evaluate("[...document.querySelectorAll('table.chart')].map(t => [t.className, "
                               "t.getBoundingClientRect().width, t.getBoundingClientRect().height])")
        bars = page.evaluate("[...document.querySelectorAll('td.bar div')].map(d => [d.getBoundingClientRect().width, "
                             "[...d.children].map(s => [s.title, s.getBoundingClientRect().width])])")
        headings = page.evaluate("[...document.querySelectorAll('h2')].map(h => h.textContent)")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "class-report.png"), full_page=True)
        browser.close()
    assert not errors, errors
    assert [name for name, _, _ in charts] == ["chart scores", "chart statuses"], charts
    assert all(width > 300 and height > 50 for _, width, height in charts), charts
    longest = max(sum(int(title.rsplit(": ", 1)[1]) for title, _ in spans) for _, spans in bars)
    for width, spans in bars:
        for title, drawn in spans:
            assert drawn == pytest.approx(width * int(title.rsplit(": ", 1)[1]) / longest, abs=1), bars
    assert headings == ["Needs attention", "Scores", "Students", "Tests most often failed", "Slowest notebooks"]


def test_one_notebook_gets_a_report_on_the_terminal(class_grades, capsys):
    notebook = class_grades.submitted / "cleo" / "attention" / "sdpa.ipynb"
    assert cli.main(["grade", str(notebook), "--seed", str(SEED)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sdpa (attention/sdpa.ipynb, Scaled dot-product attention): 8.5 / 10 points, status graded")
    assert "FAIL  causal-mask-random (hidden)" in out


def test_a_notebook_named_after_no_exercise_is_refused(tmp_path, capsys):
    notebook = tmp_path / "homework.ipynb"
    notebook.write_text("{}")
    assert cli.main(["grade", str(notebook)]) == 2
    assert "no exercise 'homework'" in capsys.readouterr().err



@pytest.fixture
def submitted(tmp_path: Path) -> Path:
    folder = tmp_path / "submitted" / "ada" / "attention"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / "attention" / "sdpa.ipynb", folder / "sdpa.ipynb")
    return tmp_path / "submitted"


def test_an_unknown_assignment_gets_one_line_naming_the_known_ones(submitted: Path, monkeypatch, capsys):
    monkeypatch.chdir(submitted.parent)
    assert cli.main(["grade", "submitted", "--out", "out", "--assignment", "attenton"]) == 2
    out, err = capsys.readouterr()
    known = ", ".join(dict.fromkeys(exercise.assignment for exercise in EXERCISES.values()))
    assert known.startswith("attention, gqa, positions, latent, flash, decoding")
    assert out == "" and err.splitlines() == [f"no assignment attenton; the assignments are {known}"]
    assert not (submitted.parent / "out").exists()  # no journal, no half-made folder


@pytest.mark.parametrize("deeper, hint", [
    ("ada", "it looks like one student's folder: give the class's folder (submitted?)"),
    ("ada/attention", "it holds notebooks itself, as one student's assignment folder does: grade one with "
                      "`grade submitted/ada/attention/sdpa.ipynb`, or give the class's folder (submitted?)")])
def test_a_folder_one_level_too_deep_is_an_error_with_a_hint(submitted: Path, deeper: str, hint: str,
                                                             monkeypatch, capsys):
    monkeypatch.chdir(submitted.parent)
    assert cli.main(["grade", f"submitted/{deeper}", "--out", "out"]) == 2
    assert capsys.readouterr().err.strip() == (f"submitted/{deeper} holds no notebook as "
                                               f"<student>/<assignment>/<exercise>.ipynb: {hint}")
    assert not (submitted.parent / "out").exists()


def test_grade_help_lists_the_outputs_with_an_example(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["grade", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for output in ("grades.csv", "results.csv", "canvas.csv", "moodle.csv", "report.html", "feedback/<student>.md"):
        assert output in out, output
    assert "example:\n  python -m autograde grade submitted/ --out grades/" in out
    assert "attention, gqa, positions" in out  # --assignment names the assignments


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"python -m autograde {importlib.metadata.version('mha-derived')}"


def test_release_in_a_class_copy_helps_and_refuses_with_the_reason(tmp_path: Path, monkeypatch, capsys):
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")  # a class's copy of the course: no solutions/
    monkeypatch.setenv(course.VARIABLE, str(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit:
        cli.main(["release", "--help"])
    assert exit.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m autograde release")
    assert cli.main(["release"]) == 2
    assert "without their solutions" in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before  # the released exercises are left as they were
