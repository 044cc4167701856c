"""Fixtures shared by the grader's tests: one class of submissions graded once by the CLI."""

from __future__ import annotations

import csv
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.implementations import MHA_WRONG, REFERENCE_LOAD
from tests.fixtures.notebooks import ROOT, SEED, learner_notebook, write

# The class graded by `python -m autograde grade`; nbgrader grades the first three too.
CLASS_EXPECTED = {
    # student: {exercise: (score, status)}
    "ada": {"sdpa": (10, "graded"), "mha": (10, "graded")},              # the reference answers
    "bert": {"sdpa": (0, "graded"), "mha": (0, "graded")},               # the untouched release
    "cleo": {"sdpa": (8.5, "graded"), "mha": (8.5, "graded")},           # partly wrong
    "dan": {"sdpa": (0, "invalid"), "mha": (0, "missing")},              # not JSON; nothing else
    "eve": {"sdpa": (0, "invalid"), "mha": (0, "not allowed")},          # empty; calls the module
    "fay": {"sdpa": (10, "graded"), "mha": (0, "not allowed")},          # hides a call from the scan
}
NBGRADER_STUDENTS = ("ada", "bert", "cleo", "fay")


def write_class(submitted: Path) -> None:
    def notebook(student: str, exercise_id: str) -> Path:
        return submitted / student / "attention" / f"{exercise_id}.ipynb"

    for exercise_id in ("sdpa", "mha"):
        write(learner_notebook(exercise_id), notebook("ada", exercise_id))
        write(learner_notebook(exercise_id, blank=True), notebook("bert", exercise_id))
    write(learner_notebook("sdpa", {"causal_mask": (  # top-left aligned: right only for L == S
        "def causal_mask(L, S=None, device=None):\n"
        "    return torch.ones(L, L if S is None else S, dtype=torch.bool, device=device).tril()\n")}),
        notebook("cleo", "sdpa"))
    write(learner_notebook("mha", {"load_torch_mha": REFERENCE_LOAD.split("        if torch_mha")[0]
                                   + "    return module\n"}), notebook("cleo", "mha"))
    notebook("dan", "sdpa").parent.mkdir(parents=True)
    notebook("dan", "sdpa").write_text("def scaled_dot_product_attention(q, k, v, mask=None): ...\n")
    notebook("eve", "sdpa").parent.mkdir(parents=True)
    notebook("eve", "sdpa").write_bytes(b"")
    write(learner_notebook("mha", {"load_torch_mha": REFERENCE_LOAD.replace(
        "    return module", "    torch_mha(torch.zeros(1, 1, torch_mha.embed_dim), torch.zeros(1, 1, "
                            "torch_mha.embed_dim), torch.zeros(1, 1, torch_mha.embed_dim))\n    return module")}),
        notebook("eve", "mha"))
    write(learner_notebook("sdpa"), notebook("fay", "sdpa"))
    hidden = next(v for v in MHA_WRONG if v.name == "hides-torch-sdpa-behind-getattr")
    write(learner_notebook("mha", hidden.answers), notebook("fay", "mha"))


@dataclass(frozen=True)
class ClassGrades:
    submitted: Path
    out: Path
    returncode: int
    stdout: str
    stderr: str
    rows: list[dict]

    def row(self, student: str, exercise: str) -> dict:
        return next(r for r in self.rows if r["student"] == student and r["exercise"] == exercise)


@pytest.fixture(scope="session")
def class_grades(tmp_path_factory) -> ClassGrades:
    """The class above, graded by the instructor's command, as an instructor runs it."""
    base = tmp_path_factory.mktemp("class")
    submitted, out = base / "submitted", base / "grades"
    write_class(submitted)
    process = subprocess.run(
        [sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
         "--seed", str(SEED), "--jobs", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    rows = list(csv.DictReader((out / "grades.csv").open())) if (out / "grades.csv").exists() else []
    return ClassGrades(submitted, out, process.returncode, process.stdout, process.stderr, rows)
