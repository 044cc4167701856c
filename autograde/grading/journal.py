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
import os
import sqlite3
import threading
from pathlib import Path

from autograde.compare import CaseResult
from autograde.grading import provenance
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
                       "notes": list(grade.notes), "isolation": grade.isolation, "seconds": grade.seconds,
                       "results": [dataclasses.asdict(result) for result in grade.results]})


def from_json(text: str) -> Grade:
    data = json.loads(text)
    results = tuple(CaseResult(**{**r, "problems": tuple(r["problems"])}) for r in data["results"])
    return Grade(EXERCISES[data["exercise"]], data["status"], data["reason"], results, tuple(data["notes"]),
                 data["isolation"], float(data.get("seconds", 0.0)))


def read_run(folder: Path) -> tuple[dict[str, str], dict[tuple[str, str], tuple[str, Grade]]]:
    """A run's metadata, and its rows: (student, exercise) -> (notebook fingerprint, grade).

    Read without changing the run's folder.
    """
    path = folder / FILE
    if not path.is_file():
        raise JournalError(f"{folder} holds no {FILE}: is it the --out folder of a grading run?")
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        metadata = dict(db.execute("select key, value from run").fetchall())
        rows = db.execute("select student, exercise, fingerprint, grade from grades").fetchall()
    except sqlite3.Error as exc:
        raise JournalError(f"{path} cannot be read: {exc}") from None
    finally:
        db.close()
    return metadata, {(student, exercise): (notebook, from_json(text)) for student, exercise, notebook, text in rows}


def _create(path: Path, seed: int | None) -> None:
    """A new journal at `path` that holds the run's seed, made whole beside it and then renamed:
    a run stopped as it starts leaves the journal of the run before it, or this one with its seed,
    never one without a seed that a resumed run could not go on with."""
    if seed is None:
        raise JournalError(f"{path} holds no run to resume")
    fresh = path.with_name(f"{path.name}.new")
    fresh.unlink(missing_ok=True)
    db = sqlite3.connect(fresh, isolation_level=None)
    try:
        db.executescript(_SCHEMA)
        db.execute("insert into run values ('seed', ?)", (str(seed),))
    finally:
        db.close()
    for left in ("-wal", "-shm"):  # the run before's, which must not be read as this one's
        path.with_name(path.name + left).unlink(missing_ok=True)
    os.replace(fresh, path)


class Journal:
    """Thread-safe: grading threads record their rows as they finish."""

    def __init__(self, folder: Path, seed: int | None, resume: bool):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FILE
        if not resume or not path.exists():
            _create(path, seed)
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

    def describe(self, shard: tuple[int, int], exercises: list[str], students: list[str]) -> None:
        """Record what the run grades and with what, so that shards can be merged and checked.

        A resumed run must be the same shard, graded by the same grader on the same release:
        otherwise its rows would mix two gradings.
        """
        now = {"shard": f"{shard[0]}/{shard[1]}", "release": provenance.release_fingerprint(),
               "grader": provenance.grader_fingerprint()}
        before = self.metadata()
        for key, value in now.items():
            if key in before and before[key] != value:
                what = {"shard": "shard", "release": "release (exercises/)",
                        "grader": "grader or reference solutions"}[key]
                raise JournalError(f"the run recorded here was graded with another {what} "
                                   f"({before[key]}, now {value}): grade into another folder")
        now.update(exercises=json.dumps(exercises), students=json.dumps(students))
        with self._lock:
            self._db.executemany("insert or replace into run values (?, ?)", list(now.items()))

    def metadata(self) -> dict[str, str]:
        """The run's seed, shard, fingerprints, exercises and students, as recorded."""
        with self._lock:
            return dict(self._db.execute("select key, value from run").fetchall())

    def adopt(self, metadata: dict[str, str]) -> None:
        """Take another run's metadata (a merge records what its shards were graded with)."""
        with self._lock:
            self._db.executemany("insert or replace into run values (?, ?)", list(metadata.items()))

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
