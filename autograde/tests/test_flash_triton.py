"""`flash_triton`: the tiled forward pass as a Triton kernel.

Without a CUDA GPU, kernels run in Triton's interpreter (TRITON_INTERPRET=1), which executes
them on the CPU with numpy, slowly, so the cases stay small (L, S <= 192, float32). With a
GPU the probe moves the inputs there. Every case also checks that a Triton kernel was launched.

The hidden tests are parametrised by the contract's axes: L < S, L = S, L > S; lengths ragged
(not multiples of 16, the smallest block `tl.dot` takes) or multiples of 64; causal or not.
The kernel picks its own blocks, so the default-or-given axis of `flash_forward` has no place
here; float16 is graded only where the contract grades it, on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import Draw, Inputs
from autograde.exercises.flash_triton import LAUNCHES, OUTSIDE, TRITON, WRITTEN, triton_attention
from autograde.rules import judge
from autograde.testing import assert_rule, assert_same, oracle
from autograde.tests.test_flash_forward import (
    CAUSAL,
    HEAD_DIMS,
    LENGTHS,
    attention_by_definition,
    attention_inputs,
    rows_attending_nothing,
)

LAUNCH_RULE = judge.launched(TRITON)
MAX_LENGTH = 192  # three blocks of 64; the interpreter takes about half the time of 256
# The axes of the hidden tests (their values are the test ids).
EDGES = ("ragged lengths", "lengths multiples of 64")
TRITON_CASES = {f"{lengths}, {edges}, {causal}": (lengths, edges, causal)
                for lengths in LENGTHS for edges in EDGES for causal in CAUSAL}


@oracle(of=triton_attention)
def triton_attention_by_definition(inputs: Inputs) -> dict:
    """out and lse in float64, and what the solution's wrapper reports: one launch, which stored both
    results, and no reduction outside it. The solution's kernel itself, interpreted, took nine tenths
    of a notebook's grading on the CPU; it is graded like any other against this oracle."""
    out, lse = attention_by_definition(inputs["q"], inputs["k"], inputs["v"], inputs["causal"])
    return {"out": out, "lse": lse, LAUNCHES: 1, WRITTEN: "out and lse",
            OUTSIDE: 0, f"{OUTSIDE} (call)": "no reduction"}


def triton_inputs(draw: Draw, B: int, H: int, L: int, S: int, d: int, causal: bool) -> dict:
    return attention_inputs(draw, B, H, L, S, d, torch.float32, causal=causal)


# Visible cases: at least two of the notebook's blocks of 64 queries or keys where a case has
# more than one, so that moving from block to block is checked where a learner sees it.

def square(draw: Draw) -> Inputs:
    return Inputs(triton_inputs(draw, 1, 2, 128, 128, 16, False), "L == S")


def ragged(draw: Draw) -> Inputs:
    return Inputs(triton_inputs(draw, 2, 1, 90, 140, 32, False), "L != S, ragged last blocks of queries and keys")


def causal_square(draw: Draw) -> Inputs:
    return Inputs(triton_inputs(draw, 1, 2, 100, 100, 16, True), "L == S, ragged")


def causal_more_queries(draw: Draw) -> Inputs:
    return Inputs(triton_inputs(draw, 1, 1, 80, 46, 64, True), rows_attending_nothing(80, 46))


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def draw_lengths(draw: Draw, lengths: str, edges: str) -> tuple[int, int]:
    """(L, S) up to MAX_LENGTH as the axes say: both ragged (not multiples of 16) or both multiples of 64."""
    step = 1 if edges == EDGES[0] else 64
    while True:
        S = step * draw.integer(1, MAX_LENGTH // step)
        L = S if lengths == "L = S" else step * draw.integer(1, MAX_LENGTH // step)
        in_order = {"L < S": L < S, "L = S": L == S, "L > S": L > S}[lengths]
        if in_order and (step == 64 or (L % 16 and S % 16)):
            return L, S


def random_sizes(draw: Draw, lengths: str, edges: str, causal: bool) -> Inputs:
    L, S = draw_lengths(draw, lengths, edges)
    values = triton_inputs(draw, draw.integer(1, 2), draw.integer(1, 2), L, S, draw.choice(HEAD_DIMS), causal)
    return Inputs(values, rows_attending_nothing(L, S) if causal and L > S else "random sizes")


# The tests.

@pytest.mark.points(2.0)
@pytest.mark.uses(TRITON)
def test_triton_square(submission, reference, draw):
    """out and lse from a Triton kernel, L == S"""
    inputs = square(draw)
    got, expected = submission.triton_attention(inputs), reference.triton_attention(inputs)
    assert_same(got, expected, inputs, ignore=LAUNCH_RULE.keys)
    assert_rule(got, expected, LAUNCH_RULE, inputs)


@pytest.mark.points(2.0)
@pytest.mark.uses(TRITON)
def test_triton_ragged(submission, reference, draw):
    """out and lse when L and S are not multiples of the blocks"""
    inputs = ragged(draw)
    got, expected = submission.triton_attention(inputs), reference.triton_attention(inputs)
    assert_same(got, expected, inputs, ignore=LAUNCH_RULE.keys)
    assert_rule(got, expected, LAUNCH_RULE, inputs)


@pytest.mark.points(2.0)
@pytest.mark.uses(TRITON)
def test_triton_causal(submission, reference, draw):
    """the causal mask, L == S"""
    inputs = causal_square(draw)
    got, expected = submission.triton_attention(inputs), reference.triton_attention(inputs)
    assert_same(got, expected, inputs, ignore=LAUNCH_RULE.keys)
    assert_rule(got, expected, LAUNCH_RULE, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(TRITON)
def test_triton_causal_more_queries(submission, reference, draw):
    """rows that attend nothing give out 0 and lse -inf"""
    inputs = causal_more_queries(draw)
    got, expected = submission.triton_attention(inputs), reference.triton_attention(inputs)
    assert_same(got, expected, inputs, ignore=LAUNCH_RULE.keys)
    assert_rule(got, expected, LAUNCH_RULE, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("lengths, edges, causal", list(TRITON_CASES.values()), ids=list(TRITON_CASES))
@pytest.mark.points(2.5)
@pytest.mark.uses(TRITON)
def test_triton_random(submission, reference, draw, lengths, edges, causal):
    """L < S, L = S, L > S up to 192; ragged or multiples of 64; causal or not"""
    inputs = random_sizes(draw, lengths, edges, CAUSAL[causal])
    got, expected = submission.triton_attention(inputs), reference.triton_attention(inputs)
    assert_same(got, expected, inputs, ignore=LAUNCH_RULE.keys)
    assert_rule(got, expected, LAUNCH_RULE, inputs)
