"""A class's copy of the course (`autograde/` and `exercises/`, no `solutions/`): the learners' checks
run from the expected values released with the exercises, and say what no solution can be had for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograde import solutions
from autograde.grading import expected
from autograde.grading.proxies import LearnerFailed
from autograde.registry import EXERCISES
from tests.fixtures.notebooks import ROOT

pytestmark = [pytest.mark.xdist_group("autograde_class_copy"), pytest.mark.timeout(600)]

# Runs in the copy, in a fresh interpreter: the cells on stdin define the functions, then the
# visible tests run on them as `check()` runs them; prints each exercise's failing tests.
CHECK_IN_THE_COPY = """
import json, sys
from autograde import course, registry
from autograde.frontends.check import run_in_kernel
answers = json.load(sys.stdin)
failing = {}
for exercise_id, cells in answers.items():
    namespace = {"__name__": "__main__"}
    for cell in cells:
        exec(cell, namespace)
    results, violations, _ = run_in_kernel(registry.get(exercise_id), namespace, None, visible_only=True)
    failing[exercise_id] = [r.name for r in results if not r.passed] + [v.name for v in violations]
    failing[exercise_id + " problems"] = [p for r in results for p in r.problems][:3]
print(json.dumps({"failing": failing, "has_solutions": course.has_solutions(), "root": str(course.root())}))
"""

WRONG_SCALE = '''
import math, torch
def causal_mask(L, S=None, device=None):
    S = L if S is None else S
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L)
def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / q.shape[-1]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))
    return weights @ v, weights
'''


@pytest.fixture(scope="module")
def class_copy(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("class-copy")
    shutil.copytree(ROOT / "autograde", copy / "autograde", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "exercises", copy / "exercises")
    return copy


def check_in(copy: Path, answers: dict[str, list[str]]) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("AUTOGRADE_")}
    env.update(PYTHONPATH=str(copy), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CHECK_IN_THE_COPY], cwd=copy, env=env, text=True,
                          input=json.dumps(answers), capture_output=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def solution(exercise) -> list[str]:
    return solutions.solution_cells(json.loads((ROOT / "solutions" / exercise.notebook).read_text()))


def test_every_solution_passes_its_visible_tests_from_the_released_values_alone(class_copy: Path):
    assert not (class_copy / "solutions").exists()
    found = check_in(class_copy, {exercise.id: solution(exercise) for exercise in EXERCISES.values()})
    assert found["root"] == str(class_copy) and found["has_solutions"] is False
    assert {key: value for key, value in found["failing"].items() if value} == {}


def test_a_wrong_answer_fails_the_released_checks_with_what_differs(class_copy: Path):
    found = check_in(class_copy, {"sdpa": [WRONG_SCALE]})
    assert "no-mask" in " ".join(found["failing"]["sdpa"]), found
    assert found["failing"]["sdpa problems"], found


def test_a_call_outside_the_visible_tests_says_it_needs_the_solutions(monkeypatch, class_copy: Path):
    monkeypatch.setenv("AUTOGRADE_COURSE", str(class_copy))
    released = expected.Released(EXERCISES["sdpa"])
    import torch

    with pytest.raises(LearnerFailed, match="^not run: no expected value.*hidden tests.*need the course's solutions"):
        released.call("scaled_dot_product_attention", (torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3)), {})
