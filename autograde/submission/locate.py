"""Which uploaded notebook answers an exercise: the one by its name, else one that looks renamed.

Learners rename notebooks (`sdpa (1).ipynb`, `Copy of sdpa.ipynb`, `GQA.ipynb`); the class
grader and the Gradescope autograder grade such a notebook the same way, with a note asking for
the right name. Links are never followed: they could point at the solutions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from autograde.cases import Exercise
from autograde.registry import EXERCISES

IGNORED_FOLDERS = ("__MACOSX", ".ipynb_checkpoints")


@dataclass(frozen=True)
class Found:
    path: Path | None  # the notebook to grade, or None
    note: str  # how it was found, or why none was


def _tokens(name: str) -> list[str]:
    return re.findall(r"[a-z]+|[0-9]+", name.lower())


def looks_like(stem: str, exercise_id: str) -> bool:
    """Whether a file name contains the exercise's name: `sdpa (1)`, `Copy of sdpa`, `SDPA-final`."""
    want, have = _tokens(exercise_id), _tokens(stem)
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def uploaded_notebooks(submission: Path) -> tuple[list[Path], list[str]]:
    """The notebooks uploaded (at the top or in folders), nearest the top first; and notes on
    those passed over. Links are never followed: they could point at the solutions."""
    notebooks, notes = [], []
    for path in submission.rglob("*.ipynb"):
        relative = path.relative_to(submission)
        if any(part.startswith(".") or part in IGNORED_FOLDERS for part in relative.parts):
            continue
        if any((submission / Path(*relative.parts[:n])).is_symlink() for n in range(1, len(relative.parts) + 1)):
            notes.append(f"{relative} is a link, not a file: not graded")
        elif path.is_file():
            notebooks.append(path)
    return sorted(notebooks, key=lambda p: (len(p.parts), str(p))), notes


def find(exercise: Exercise, notebooks: list[Path], claimed: set[Path], submission: Path) -> Found:
    """The notebook for `exercise`: one named `<id>.ipynb`, else the one notebook whose name
    contains the exercise's (and no other exercise's) and that no other exercise claims."""
    name = f"{exercise.id}.ipynb"
    exact = sorted((p for p in notebooks if p.name == name),
                   key=lambda p: not p.relative_to(submission).as_posix().endswith(exercise.notebook))
    if exact:
        chosen, others = exact[0], exact[1:]
        skipped = f"; not graded, by the same name: {', '.join(str(p.relative_to(submission)) for p in others)}"
        return Found(chosen, f"graded {chosen.relative_to(submission)}" + (skipped if others else ""))
    others = [e.id for e in EXERCISES.values() if e is not exercise]
    renamed = [p for p in notebooks if p not in claimed and looks_like(p.stem, exercise.id)
               and not any(looks_like(p.stem, other) for other in others)]
    if len(renamed) == 1:
        relative = renamed[0].relative_to(submission)
        return Found(renamed[0], f"graded {relative} as {name}: it looks renamed; please name it {name}")
    if renamed:
        listed = ", ".join(str(p.relative_to(submission)) for p in renamed)
        return Found(None, f"no {name} was uploaded, and several notebooks look like it ({listed}): "
                           f"upload one, named {name}")
    return Found(None, f"no {name} was uploaded")


def find_all(exercises: list[Exercise], submission: Path) -> tuple[list[Found], list[str]]:
    """A `Found` per exercise, and notes on the notebooks that were not graded."""
    notebooks, notes = uploaded_notebooks(submission) if submission.is_dir() else ([], [])
    claimed = {p for p in notebooks if p.name in {f"{e.id}.ipynb" for e in EXERCISES.values()}}
    found = []
    for exercise in exercises:
        found.append(find(exercise, notebooks, claimed, submission))
        claimed.add(found[-1].path)
    names = [f"{exercise.id}.ipynb" for exercise in exercises]
    graded = {f.path for f in found}
    notes += [f"{p.relative_to(submission)} was not graded: this assignment grades {' and '.join(names)}"
              for p in notebooks if p not in graded and p.name not in names]
    if not notebooks:
        notes.append("no notebook (.ipynb) was found among the uploaded files")
    return found, notes
