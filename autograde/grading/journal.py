"""The record of a grading run, one row per (student, exercise), so that a run can resume.

Rows live in an SQLite database in the output folder (`journal.sqlite3`): each row is one
transaction, so an interrupted run — Ctrl-C, SIGTERM, a power cut — leaves every finished
row whole and no half row; the primary key makes a row impossible to record twice. Each row
keeps the submitted notebook's SHA-256, so a resumed run grades again any notebook that has
changed since. The run's seed is kept too: a resumed run draws the same hidden tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import threading
from pathlib import Path

from autograde.grading.compare import CaseResult
from autograde.grading.grade import Grade
from autograde.registry import EXERCISES

FILE = "journal.sqlite3"
_SCHEMA = """
create table if not exists run (key text primary key, value text not null);
create table if not exists grades (
    student text not null, exercise text not null, fingerprint text not null, grade text not null,
    primary key (student, exercise));
"""


class JournalError(Exception):
    pass


def fingerprint(path: Path) -> str:
    """What the notebook was when it was graded: its bytes' SHA-256, or how it was not a file."""
    if path.is_symlink():
        return "link"
    if not path.is_file():
        return "folder" if path.is_dir() else "missing"
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def to_json(grade: Grade) -> str:
    return json.dumps({"exercise": grade.exercise.id, "status": grade.status, "reason": grade.reason,
                       "notes": list(grade.notes), "isolation": grade.isolation,
                       "results": [dataclasses.asdict(result) for result in grade.results]})


def from_json(text: str) -> Grade:
    data = json.loads(text)
    results = tuple(CaseResult(**{**r, "problems": tuple(r["problems"])}) for r in data["results"])
    return Grade(EXERCISES[data["exercise"]], data["status"], data["reason"], results, tuple(data["notes"]),
                 data["isolation"])


class Journal:
    """Thread-safe: grading threads record their rows as they finish."""

    def __init__(self, folder: Path, seed: int | None, resume: bool):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FILE
        if not resume:
            path.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("pragma journal_mode = wal")
        self._db.execute("pragma synchronous = full")
        self._db.executescript(_SCHEMA)
        recorded = self._db.execute("select value from run where key = 'seed'").fetchone()
        if recorded is None:
            if seed is None:
                raise JournalError(f"{path} holds no run to resume")
            self._db.execute("insert into run values ('seed', ?)", (str(seed),))
            self.seed = seed
        else:
            self.seed = int(recorded[0])
            if seed is not None and seed != self.seed:
                raise JournalError(f"the run in {folder} used seed {self.seed}, not {seed}: "
                                   f"resume it without --seed, or grade into another folder")

    def done(self) -> dict[tuple[str, str], str]:
        """(student, exercise) -> the fingerprint of the notebook that was graded."""
        with self._lock:
            rows = self._db.execute("select student, exercise, fingerprint from grades").fetchall()
        return {(student, exercise): notebook_hash for student, exercise, notebook_hash in rows}

    def record(self, student: str, notebook_hash: str, grade: Grade) -> None:
        with self._lock:
            self._db.execute("insert or replace into grades values (?, ?, ?, ?)",
                             (student, grade.exercise.id, notebook_hash, to_json(grade)))

    def grades(self) -> dict[tuple[str, str], Grade]:
        with self._lock:
            rows = self._db.execute("select student, exercise, grade from grades").fetchall()
        return {(student, exercise): from_json(text) for student, exercise, text in rows}

    def close(self) -> None:
        self._db.close()
