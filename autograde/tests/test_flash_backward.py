"""`flash_backward`: the tiled backward pass, and FlashAttention as an autograd Function.

The backward's inputs `out` and `lse` come from the test case (computed by the definition,
in float64), so that its grade does not depend on the learner's forward; `FlashAttention`
runs the learner's own forward (part 0 of the notebook). Rules graded in cases of their own:
the memory bound of the forward, and that `FlashAttention` saves exactly q, k, v, out, lse;
both measured in the learner's process, and both also graded from outside it, in one hidden
case as in `flash_forward`: through `FlashAttention.apply` and its backward with B = H = 2 and
L = S = 2048 (as many scores as one head at 4096, in a quarter of the blocks' steps), the memory
of the learner's processes must rise by less than all the scores would take at two bytes each,
which a forward that keeps its probabilities (in any form) breaks. And the gradients
are computed by hand: while `flash_attention_backward` or `FlashAttention`'s backward runs, autograd
records no graph (`measure.AutogradRecorded`, in the learner's process and thread: autograd through
a recomputed forward, chunked to keep the memory rule, is what it catches).

The hidden tests are parametrised by the contract's axes, as in `flash_forward`: L < S, L = S,
L > S; lengths ragged or multiples of the blocks; causal or not; the default blocks or given
ones; each case in float32 or float64 (every value of every axis meets both),
and float16 cases of their own (a float32 lse, as the
forward returns it, and gradients in float16). Every hidden case has at least two key blocks
past the first, so that a D_i summed over one key block only shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.flash_backward import (
    APPLY_RECORDED,
    BACKWARD,
    FUNCTION,
    apply_gradients,
    backward,
)
from autograde.exercises.flash_forward import DEFAULT_BLOCK
from autograde.observe import CallCost
from autograde.rules import judge
from autograde.testing import assert_rule, assert_same, observed, observed_rows, oracle
from autograde.tests.test_flash_forward import (
    BLOCK_SIZES,
    CAUSAL,
    CHECKED_ROW_STEP,
    EDGES,
    FLOAT16_CASES,
    FORWARD_CASES,
    HEAD_DIMS,
    LENGTHS,
    assert_whole_scores_kept,
    attention_by_definition,
    attention_inputs,
    draw_lengths,
    lse_dtype,
    rows_attending_nothing,
    whole_scores_note,
)
from autograde.tests.test_sdpa import bottom_right_causal

MEMORY_RULE, SAVED_RULE = judge.memory(BACKWARD), judge.saved(FUNCTION)
BY_HAND_RULE, BY_HAND_APPLY_RULE = judge.by_hand(BACKWARD), judge.by_hand(f"{FUNCTION}'s backward")

# The axes of the hidden tests: those of the forward pass; FlashAttention.apply has the default blocks only.
BACKWARD_CASES = FORWARD_CASES
APPLY_CASES = alternate_dtypes({f"{lengths}, {edges}, {causal}": (lengths, edges, causal)
                                for lengths in LENGTHS for edges in EDGES for causal in CAUSAL})


def backward_inputs(draw: Draw, B: int, H: int, L: int, S: int, d: int, dtype: torch.dtype, causal: bool,
                    **blocks) -> dict:
    """q, k, v, and the out, lse and dout that the backward receives, in `dtype` (lse in float32 for
    float16 inputs, as the forward returns it)."""
    drawn = apply_inputs_drawn(draw, B, H, L, S, d, dtype, causal)
    q, k, v = (drawn[name] for name in ("q", "k", "v"))
    out, lse = attention_by_definition(q, k, v, causal)
    return {"q": q, "k": k, "v": v, "out": out.to(dtype), "lse": lse.to(lse_dtype(dtype)), "dout": drawn["dout"],
            "causal": causal, **blocks}


def apply_inputs_drawn(draw: Draw, B: int, H: int, L: int, S: int, d: int, dtype: torch.dtype, causal: bool) -> dict:
    """q, k, v and dout in `dtype`: what FlashAttention.apply and its backward are given (out and lse are
    its own)."""
    values = attention_inputs(draw, B, H, L, S, d, dtype)
    return {**values, "dout": draw.normal(B, H, L, d, dtype=dtype), "causal": causal}


# Oracles.


@oracle(of=backward)
def backward_by_definition(inputs: Inputs) -> dict:
    """dq, dk, dv in float64 from the dense formulas of the backward, with the case's out and lse
    as the learner's call receives them: the solution's tiles cost the grader more than these."""
    return gradients_by_definition(*(inputs[name] for name in ("q", "k", "v", "out", "lse", "dout")),
                                   inputs["causal"])


def gradients_by_definition(q, k, v, out, lse, dout, causal: bool) -> dict:
    """With P = exp(scale * q k^T - lse) (0 where masked, and in a row that attends nothing):
    dv = P^T dout, dS = P * (dout v^T - rowsum(dout * out)), dq = scale * dS k, dk = scale * dS^T q."""
    L, S, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(~bottom_right_causal(L, S), -math.inf)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # lse -inf: -inf - (-inf) is NaN, its weights 0
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(dim=-1, keepdim=True))
    return {"dq": ds @ k * scale, "dk": ds.transpose(-2, -1) @ q * scale, "dv": p.transpose(-2, -1) @ dout}


@oracle(of=apply_gradients)
def apply_gradients_by_definition(inputs: Inputs) -> dict:
    """out by the definition, its gradients by the dense formulas, and no graph recorded."""
    q, k, v, dout = (inputs[name] for name in ("q", "k", "v", "dout"))
    out, lse = attention_by_definition(q, k, v, inputs["causal"])
    grads = gradients_by_definition(q, k, v, out, lse, dout, inputs["causal"])
    return {"out": out, "q.grad": grads["dq"], "k.grad": grads["dk"], "v.grad": grads["dv"], APPLY_RECORDED: 0}


# Visible cases.

def ragged(draw: Draw) -> Inputs:
    return Inputs(backward_inputs(draw, 2, 2, 37, 50, 16, torch.float64, False, block_q=16, block_k=16),
                  "L != S, neither a multiple of its block size")


def causal_square(draw: Draw) -> Inputs:
    return Inputs(backward_inputs(draw, 1, 3, 48, 48, 32, torch.float32, True, block_q=16, block_k=32),
                  "L == S, blocks of different sizes")


def causal_more_queries(draw: Draw) -> Inputs:
    return Inputs(backward_inputs(draw, 2, 1, 30, 19, 16, torch.float64, True, block_q=8, block_k=8),
                  rows_attending_nothing(30, 19))


def float16_inputs(draw: Draw) -> Inputs:
    return Inputs(backward_inputs(draw, 2, 2, 60, 90, 32, torch.float16, True, block_q=16, block_k=32),
                  "float16 q, k, v, out and dout with a float32 lse, as the forward returns it; gradients in float16")


def memory_inputs(draw: Draw) -> Inputs:
    inputs = Inputs(backward_inputs(draw, 2, 2, 160, 192, 16, torch.float32, False, block_q=32, block_k=32))
    return Inputs(inputs.values, whole_scores_note(inputs))


def apply_inputs(draw: Draw) -> Inputs:
    return Inputs(backward_inputs(draw, 2, 2, 40, 56, 32, torch.float64, False),
                  "gradients of (out * dout).sum() through FlashAttention.apply, with your forward")


def saved_inputs(draw: Draw) -> Inputs:
    return Inputs(backward_inputs(draw, 1, 2, 24, 24, 16, torch.float64, True), "what the forward saves")


# The case whose memory is measured from outside: as many scores as flash_forward's (64 MiB in float32,
# 32 MiB allowed), over two batches and two heads, so that the default blocks of 64 take a quarter of
# the steps one head at 4096 would; d = 8, so that q, k, v, dout and the gradients take what they take
# there at d = 16. The reference's forward and backward gain and touch about half of what is allowed
# (16 MiB, at both shapes; at d = 16 here, 0.7x); keeping the probabilities, about 4.5x it.
WHOLE_BATCH, WHOLE_HEADS, WHOLE_LENGTH, WHOLE_HEAD_DIM = 2, 2, 2048, 8


def whole_scores_inputs(draw: Draw, length: int = WHOLE_LENGTH) -> Inputs:
    B, H, n = WHOLE_BATCH, WHOLE_HEADS, length
    values = attention_inputs(draw, B, H, n, n, WHOLE_HEAD_DIM, torch.float32)
    return Inputs({**values, "dout": draw.normal(B, H, n, WHOLE_HEAD_DIM, dtype=torch.float32), "causal": False},
                  f"B = {B}, H = {H}, L = S = {n:,} through FlashAttention.apply and its backward, with your forward "
                  f"and its default blocks: all the scores at once take {4 * B * H * n * n / 2**20:.0f} MiB as float32")


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def random_backward(draw: Draw, lengths: str, edges: str, causal: bool, blocks: str, dtype: torch.dtype) -> Inputs:
    given = blocks == "given blocks"
    block_q, block_k = (draw.choice(BLOCK_SIZES), draw.choice(BLOCK_SIZES)) if given else (DEFAULT_BLOCK,) * 2
    L, S = draw_lengths(draw, lengths, edges, block_q, block_k)
    values = backward_inputs(draw, draw.integer(1, 2), draw.integer(1, 3), L, S, draw.choice(HEAD_DIMS), dtype,
                             causal, **({"block_q": block_q, "block_k": block_k} if given else {}))
    return Inputs(values, rows_attending_nothing(L, S) if causal and L > S else "random sizes")


def random_apply(draw: Draw, lengths: str, edges: str, causal: bool) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    L, S = draw_lengths(draw, lengths, edges, DEFAULT_BLOCK, DEFAULT_BLOCK)
    values = apply_inputs_drawn(draw, draw.integer(1, 2), draw.integer(1, 3), L, S, draw.choice(HEAD_DIMS),
                                torch.float64, causal)
    return Inputs(values, "through FlashAttention.apply, with your forward and its default blocks")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(BACKWARD)
def test_backward_ragged(submission, reference, draw):
    """dq, dk, dv when L and S are not multiples of the blocks"""
    inputs = ragged(draw)
    got, expected = submission.backward(inputs), reference.backward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(BACKWARD)
def test_backward_causal(submission, reference, draw):
    """dq, dk, dv with the causal mask, L == S"""
    inputs = causal_square(draw)
    got, expected = submission.backward(inputs), reference.backward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(BACKWARD)
def test_backward_causal_more_queries(submission, reference, draw):
    """rows with lse -inf contribute no gradient"""
    inputs = causal_more_queries(draw)
    got, expected = submission.backward(inputs), reference.backward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(BACKWARD)
def test_backward_float16(submission, reference, draw):
    """float16 inputs with a float32 lse: gradients in float16"""
    inputs = float16_inputs(draw)
    got, expected = submission.backward(inputs), reference.backward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(BACKWARD)
def test_backward_memory_rule(submission, reference, draw):
    """no tensor larger than the inputs or one block of scores; gradients by hand, not by autograd"""
    inputs = memory_inputs(draw)
    got, expected = submission.backward_memory(inputs), reference.backward_memory(inputs)
    assert_rule(got, expected, MEMORY_RULE, inputs)
    assert_rule(got, expected, BY_HAND_RULE, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(FUNCTION)
def test_flash_attention_apply(submission, reference, draw):
    """FlashAttention.apply: out and the gradients of q, k, v"""
    inputs = apply_inputs(draw)
    got, expected = submission.apply_gradients(inputs), reference.apply_gradients(inputs)
    assert_same(got, expected, inputs, ignore=BY_HAND_APPLY_RULE.keys)
    assert_rule(got, expected, BY_HAND_APPLY_RULE, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(FUNCTION)
def test_saved_tensors_rule(submission, reference, draw):
    """FlashAttention saves exactly q, k, v, out, lse for the backward"""
    inputs = saved_inputs(draw)
    got, expected = submission.saved_tensors(inputs), reference.saved_tensors(inputs)
    assert_rule(got, expected, SAVED_RULE, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("lengths, edges, causal, blocks, dtype", list(BACKWARD_CASES.values()),
                         ids=list(BACKWARD_CASES))
@pytest.mark.points(1.0)
@pytest.mark.uses(BACKWARD)
def test_backward_random(submission, reference, draw, lengths, edges, causal, blocks, dtype):
    """L < S, L = S, L > S; ragged or not; causal or not; default or given blocks; float32 or float64"""
    drawn = random_backward(draw, lengths, edges, CAUSAL[causal], blocks, torch.float64)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.backward(inputs), reference.backward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("lengths, causal", list(FLOAT16_CASES.values()), ids=list(FLOAT16_CASES))
@pytest.mark.points(0.5)
@pytest.mark.uses(BACKWARD)
def test_backward_float16_random(submission, reference, draw, lengths, causal):
    """float16 inputs with a float32 lse, ragged lengths and given blocks: L < S, L = S, L > S, causal or not"""
    inputs = random_backward(draw, lengths, EDGES[0], CAUSAL[causal], "given blocks", torch.float16)
    got, expected = submission.backward(inputs), reference.backward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("lengths, edges, causal, dtype", list(APPLY_CASES.values()), ids=list(APPLY_CASES))
@pytest.mark.points(1.5)
@pytest.mark.uses(FUNCTION)
def test_flash_attention_apply_random(submission, reference, draw, lengths, edges, causal, dtype):
    """FlashAttention.apply: L < S, L = S, L > S; ragged or not; causal or not; float32 or float64"""
    drawn = random_apply(draw, lengths, edges, CAUSAL[causal])
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.apply_gradients(inputs), reference.apply_gradients(inputs)
    assert_same(got, expected, inputs, ignore=BY_HAND_APPLY_RULE.keys)
    assert_rule(got, expected, BY_HAND_APPLY_RULE, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(FUNCTION)
def test_whole_scores_measured_from_outside(submission, draw):
    """B = H = 2, L = S = 2048: FlashAttention.apply and its backward, memory measured from outside your process"""
    submission.apply_gradients(whole_scores_inputs(draw, 2 * DEFAULT_BLOCK))  # code run for the first time
    inputs = whole_scores_inputs(draw)
    # out only, on some of its rows, against the definition: the gradients are graded elsewhere
    rows = torch.arange(0, inputs["q"].shape[-2], CHECKED_ROW_STEP)
    out, _ = attention_by_definition(inputs["q"], inputs["k"], inputs["v"], inputs["causal"], rows)
    checked = Inputs(inputs.values, f"{inputs.note}; out checked on {len(rows)} rows, every {CHECKED_ROW_STEP}th")

    def measured_call() -> CallCost:
        with submission.cost_measured() as peak:
            got = submission.apply_gradients(inputs)
        try:
            got = observed_rows(got, {"out": inputs["q"].shape}, rows, axis=2)
        except AssertionError as error:
            raise AssertionError(f"inputs: {checked.describe()}\n{error}") from None
        assert_same(got, observed({"out": out}), checked)
        return peak

    assert_whole_scores_kept(measured_call, "FlashAttention.apply(q, k, v, causal=False) and its backward", inputs)
