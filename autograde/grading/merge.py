"""Merge the shards of a class graded on several machines into the one run they add up to.

Each shard is the `--out` folder of `python -m autograde grade ... --shard K/N`. The merge
refuses shards that cannot belong together (different seeds, releases, graders or exercises;
a shard missing, given twice, or not finished) and otherwise gives the rows, in the order one
run over the whole class would give them.
"""

from __future__ import annotations

import json
from pathlib import Path

from autograde.grading.grade import Grade
from autograde.grading.journal import JournalError, read_run

SHARED = {"seed": "seed", "release": "release (exercises/)", "grader": "grader or reference solutions",
          "exercises": "exercises"}


class MergeError(Exception):
    pass


def _describe(folder: Path) -> tuple[dict[str, str], dict]:
    try:
        metadata, rows = read_run(folder)
    except JournalError as exc:
        raise MergeError(str(exc)) from None
    missing = {"seed", "shard", *SHARED, "students"} - set(metadata)
    if missing:
        raise MergeError(f"{folder} does not say its {', '.join(sorted(missing))}: "
                         "grade it again with this version of the grader")
    return metadata, rows


def merge(folders: list[Path]) -> tuple[dict[str, str], list[tuple[str, str, Grade]]]:
    """The shards' common metadata and every (student, notebook fingerprint, grade) row, in order."""
    if not folders:
        raise MergeError("no shard folders given")
    runs = [(folder, *_describe(folder)) for folder in folders]
    first_folder, first, _ = runs[0]
    for folder, metadata, _ in runs[1:]:
        for key, what in SHARED.items():
            if metadata[key] != first[key]:
                raise MergeError(f"{folder} and {first_folder} were graded with different {what}: "
                                 f"{metadata[key]} against {first[key]}")
    shards = [tuple(int(part) for part in metadata["shard"].split("/")) for _, metadata, _ in runs]
    count = shards[0][1]
    if any(n != count for _, n in shards):
        raise MergeError(f"the shards were cut in different numbers: {', '.join(m['shard'] for _, m, _ in runs)}")
    given = sorted(k for k, _ in shards)
    if given != list(range(1, count + 1)):
        twice = sorted({k for k in given if given.count(k) > 1})
        absent = sorted(set(range(1, count + 1)) - set(given))
        raise MergeError(f"shards of {count}: " + "; ".join(
            ([f"missing {', '.join(f'{k}/{count}' for k in absent)}"] if absent else [])
            + ([f"given twice {', '.join(f'{k}/{count}' for k in twice)}"] if twice else [])))
    exercises = json.loads(first["exercises"])
    rows: dict[str, list[tuple[str, str, Grade]]] = {}
    for folder, metadata, recorded in runs:
        for student in json.loads(metadata["students"]):
            if student in rows:
                raise MergeError(f"{student} was graded in two shards")
            absent = [e for e in exercises if (student, e) not in recorded]
            if absent:
                raise MergeError(f"{folder} (shard {metadata['shard']}) has not finished: {student}'s "
                                 f"{', '.join(absent)} not graded; finish it with --resume")
            rows[student] = [(student, *recorded[student, e]) for e in exercises]
    common = {key: first[key] for key in SHARED} | {"shard": "1/1", "students": json.dumps(sorted(rows))}
    return common, [row for student in sorted(rows) for row in rows[student]]
