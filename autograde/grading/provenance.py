"""What a grading run depends on besides the submissions, and which students a shard grades.

A class can be graded in shards on several machines and merged (`python -m autograde merge`).
The shards must have drawn the same hidden tests (the seed), from the same release and the
same grader (its code, its tests and the reference solutions); each run records fingerprints
of these in its journal, and a merge refuses shards whose fingerprints differ.
"""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

import autograde
from autograde import course


def same_person(name: str) -> str:
    """The form in which two folder names of one student agree (case, Unicode form, spaces)."""
    return unicodedata.normalize("NFKC", name).casefold().strip()


def shard_of(student: str, count: int) -> int:
    """The shard (1 to count) that grades this student: a stable hash, the same on every machine.

    Folders of one student that differ only in case or spaces fall in the same shard, so that
    the shard that grades them sees them side by side.
    """
    digest = hashlib.sha256(same_person(student).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count + 1


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), with 1 <= K <= N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes K/N, such as 2/8, not {text!r}") from None
    if not 1 <= index <= count:
        raise ValueError(f"--shard {text}: K must be between 1 and N")
    return index, count


def _files_digest(folder: Path, patterns: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    files = sorted({path for pattern in patterns for path in folder.rglob(pattern) if path.is_file()})
    for path in files:
        if "__pycache__" in path.parts or ".ipynb_checkpoints" in path.parts:
            continue
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def release_fingerprint() -> str:
    """The learner notebooks that submissions are checked against (exercises/)."""
    return _files_digest(course.exercises(), ("*.ipynb",))


def grader_fingerprint() -> str:
    """The grader's code and tests, and the reference solutions it compares with."""
    package = Path(autograde.__file__).parent
    return f"{_files_digest(package, ('*.py', '*.ini'))}-{_files_digest(course.solutions(), ('*.ipynb',))}"
