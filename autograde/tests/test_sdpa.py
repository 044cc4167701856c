"""`sdpa`: scaled dot-product attention and the bottom-right aligned causal mask.

The tests of the exercise: each draws its inputs, makes the same calls on the learner's
functions (`submission`) and on the course's solution (`reference`, float64), and holds one
against the other. Run them on a notebook with
`pytest autograde/tests/test_sdpa.py --notebook path/to/sdpa.ipynb [--seed N]`.

The hidden tests are parametrised by the axes along which the contract lets inputs vary, so that
every graded run covers every value of each; the seed draws only sizes and values:
the number of leading dimensions (0 to 3), L < S, L = S and L > S, and the dtype (float32,
float64), with d_v != d_k; masks of every broadcast shape, with and without fully masked rows;
gradients through fully masked rows; float64 computed in float64. `causal_mask`'s hidden test
calls it for L < S, L = S, L > S and S left to its default, with `device` given and left to its
default, in every run.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import Draw, Inputs
from autograde.exercises.sdpa import ATTENTION, CAUSAL
from autograde.testing import assert_same, returned_pair

# The axes of the hidden tests (their values are the test ids). Each test's points are shared by its cases in
# amounts that binary floating point holds exactly, so that the points of every case add up to 10.
LEADING = {"2-D inputs (no batch dimension)": 0, "3-D inputs (no head dimension)": 1,
           "4-D inputs (batch and heads)": 2, "5-D inputs (three leading dimensions)": 3}
LENGTHS = ("L < S", "L = S", "L > S")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
SHAPE_CASES = {f"{leading}, {lengths}, {dtype}": (leading, lengths, dtype)
               for leading in LEADING for lengths in LENGTHS for dtype in DTYPES}
MASK_SHAPES = ("mask (L, S)", "mask (H, L, S)", "mask (B, 1, L, S)", "mask (1, H, L, S)", "mask (B, H, L, S)",
               "padding mask (B, 1, 1, S)")
ROWS = ("no row fully masked", "fully masked rows")
MASK_CASES = {f"{shape}, {rows}": (shape, rows) for shape in MASK_SHAPES for rows in ROWS}
# causal_mask's lengths: its one hidden test calls every value, with and without a device, in every run (one
# test rather than a case per value keeps what a causal_mask that never returns costs within the CPU limit).
CAUSAL_LENGTHS = ("L < S", "L = S", "L > S", "S left to its default")


def random_mask(draw: Draw, shape: tuple[int, ...], empty_rows: int = 0) -> tuple[torch.Tensor, str]:
    """A bool mask (True = may attend) in which exactly `empty_rows` rows attend nothing, and a note."""
    mask = draw.bernoulli(*shape, p=0.6)
    rows = mask.view(-1, shape[-1])
    for row in rows:  # every row keeps at least one key, unless chosen to be empty below
        row[draw.integer(0, shape[-1] - 1)] = True
    emptied = draw.py.sample(range(rows.shape[0]), empty_rows)
    rows[emptied] = False
    return mask, plural(empty_rows, "fully masked row") if empty_rows else "no row fully masked"


def mask_with_rows(draw: Draw, shape: tuple[int, ...], empty_rows: int) -> tuple[torch.Tensor, str]:
    """A bool mask in which exactly `empty_rows` rows attend nothing and every other row at least two keys
    (a row with one key has weight 1 whatever its scores, which would hide a wrong scale or softmax)."""
    mask = draw.bernoulli(*shape, p=0.6)
    rows = mask.view(-1, shape[-1])
    for row in rows:
        row[draw.py.sample(range(shape[-1]), 2)] = True
    rows[draw.py.sample(range(rows.shape[0]), empty_rows)] = False
    return mask, plural(empty_rows, "fully masked row") if empty_rows else "no row fully masked"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def bottom_right_causal(L: int, S: int) -> torch.Tensor:
    return torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)


def qkv(draw: Draw, lead: tuple[int, ...], L: int, S: int, d_k: int, d_v: int, dtype, scale=1.0) -> dict:
    return {
        "q": draw.normal(*lead, L, d_k, dtype=dtype, scale=scale),
        "k": draw.normal(*lead, S, d_k, dtype=dtype, scale=scale),
        "v": draw.normal(*lead, S, d_v, dtype=dtype),
    }


def lengths_of(draw: Draw, lengths: str) -> tuple[int, int]:
    """(L, S) as `lengths` says, both at least 2: one key or one query would hide a softmax over the wrong axis."""
    if lengths == "L < S":
        L = draw.integer(2, 6)
        return L, L + draw.integer(1, 4)
    if lengths == "L > S":
        S = draw.integer(2, 6)
        return S + draw.integer(1, 4), S
    L = draw.integer(2, 8)
    return L, L


def widths(draw: Draw, low: int = 2, high: int = 16) -> tuple[int, int]:
    """(d_k, d_v), different, d_k at least 2 (a width of 1 hides a missing scale)."""
    d_k = draw.integer(low, high)
    return d_k, draw.choice([d for d in range(1, high + 1) if d != d_k])


# Inputs of the visible tests.

def no_mask(draw: Draw) -> Inputs:
    return Inputs(qkv(draw, (2, 3), L=4, S=6, d_k=8, d_v=5, dtype=torch.float64), "no mask, L != S, d_v != d_k")


def float32(draw: Draw) -> Inputs:
    return Inputs(qkv(draw, (2, 2), L=5, S=7, d_k=16, d_v=16, dtype=torch.float32, scale=2.0), "no mask")


def broadcast_mask(draw: Draw) -> Inputs:
    values = qkv(draw, (2, 4), L=5, S=6, d_k=8, d_v=8, dtype=torch.float64)
    values["mask"], note = random_mask(draw, (5, 6))
    return Inputs(values, f"mask broadcast over batch and heads, {note}")


def fully_masked_rows(draw: Draw) -> Inputs:
    values = qkv(draw, (2, 3), L=4, S=6, d_k=8, d_v=4, dtype=torch.float32)
    values["mask"], note = random_mask(draw, (2, 1, 4, 6), empty_rows=2)
    return Inputs(values, f"mask broadcast over heads, {note}")


def square_causal(draw: Draw) -> Inputs:
    return Inputs({"calls": [(5,), (1,), (4, None, "cpu")]}, "L == S")


def rectangular_causal(draw: Draw) -> Inputs:
    return Inputs({"calls": [(3, 6), (6, 3), (1, 4), (4, 1)]}, "L < S and L > S")


# Inputs of the hidden tests: one case per value of each axis (the parameters); sizes and values from the seed.

def random_shapes(draw: Draw, leading: str, lengths: str, dtype: str) -> Inputs:
    lead = tuple(draw.integer(2, 3) for _ in range(LEADING[leading]))
    (L, S), (d_k, d_v) = lengths_of(draw, lengths), widths(draw)
    values = qkv(draw, lead, L=L, S=S, d_k=d_k, d_v=d_v, dtype=DTYPES[dtype], scale=draw.choice([0.5, 1.0, 3.0]))
    return Inputs(values, f"no mask, {lengths}, d_v != d_k")


def mask_shape(shape: str, B: int, H: int, L: int, S: int) -> tuple[int, ...]:
    return {"mask (L, S)": (L, S), "mask (H, L, S)": (H, L, S), "mask (B, 1, L, S)": (B, 1, L, S),
            "mask (1, H, L, S)": (1, H, L, S), "mask (B, H, L, S)": (B, H, L, S),
            "padding mask (B, 1, 1, S)": (B, 1, 1, S)}[shape]


def random_masks(draw: Draw, shape: str, rows: str) -> Inputs:
    """Batch, heads, L and S at least 2, so that no two mask shapes coincide."""
    B, H, L, S = draw.integer(2, 3), draw.integer(2, 4), draw.integer(2, 7), draw.integer(2, 7)
    d_k, d_v = widths(draw, high=12)
    values = qkv(draw, (B, H), L=L, S=S, d_k=d_k, d_v=d_v, dtype=torch.float64)
    values["mask"], note = mask_with_rows(draw, mask_shape(shape, B, H, L, S),
                                          empty_rows=0 if rows == "no row fully masked" else 1)
    return Inputs(values, f"{shape} with {note}")


def causal_attention(draw: Draw) -> Inputs:
    """The last row attends all S >= 2 keys, so that the scale and the softmax's axis matter."""
    S = draw.integer(2, 6)
    L = S + draw.integer(1, 4)
    values = qkv(draw, (draw.integer(1, 3), draw.integer(1, 3)), L=L, S=S, d_k=8, d_v=8, dtype=torch.float64)
    values["mask"] = bottom_right_causal(L, S)
    return Inputs(values, f"causal mask with L > S: the first {plural(L - S, 'row')} attend nothing")


def gradient_inputs(draw: Draw) -> Inputs:
    B, H, L, S = draw.integer(2, 3), draw.integer(2, 3), draw.integer(3, 6), draw.integer(2, 6)
    d_k, d_v = widths(draw, high=8)
    values = qkv(draw, (B, H), L=L, S=S, d_k=d_k, d_v=d_v, dtype=torch.float64)
    values["mask"], note = mask_with_rows(draw, (B, 1, L, S), empty_rows=draw.integer(1, 2))
    values["dout"] = draw.normal(B, H, L, d_v)
    return Inputs(values, f"mask (B, 1, L, S) with {note}; gradients of (out * dout).sum()")


def float64_inputs(draw: Draw) -> Inputs:
    """Large scores, where float32 scores or a float32 softmax are far outside float64's tolerance."""
    d_k, d_v = widths(draw, low=16, high=32)
    values = qkv(draw, (draw.integer(1, 3), draw.integer(1, 3)), L=draw.integer(2, 8), S=draw.integer(2, 8),
                 d_k=d_k, d_v=d_v, dtype=torch.float64, scale=3.0)
    return Inputs(values, "float64, no mask")


def causal_arguments(draw: Draw, lengths: str) -> tuple[int, ...]:
    """(L, S) as `lengths` says, or (L,)."""
    L = draw.integer(1, 9)
    if lengths == "S left to its default":
        return (L,)
    if lengths == "L > S":
        return L + draw.integer(1, 6), L
    return L, L + draw.integer(1, 6) if lengths == "L < S" else L


def random_causal(draw: Draw) -> Inputs:
    """Every value of CAUSAL_LENGTHS, with `device` left to its default and given."""
    calls = [causal_arguments(draw, lengths) for lengths in CAUSAL_LENGTHS for _ in range(2)]
    device_calls = [causal_arguments(draw, lengths) for lengths in CAUSAL_LENGTHS]
    return Inputs({"calls": calls, "device_calls": device_calls, "device": "cpu"},
                  "L < S, L = S, L > S and S left to its default; device left to its default and given")


# The tests.

@pytest.mark.points(1.5)
@pytest.mark.uses(ATTENTION)
def test_no_mask(submission, reference, draw):
    """outputs and weights without a mask"""
    inputs = no_mask(draw)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    got = returned_pair(submission.scaled_dot_product_attention(q, k, v), "scaled_dot_product_attention(q, k, v)")
    want = reference.scaled_dot_product_attention(q, k, v)
    assert_same(dict(zip(("out", "weights"), got)), dict(zip(("out", "weights"), want)), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_float32(submission, reference, draw):
    """float32 in, float32 out"""
    inputs = float32(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_broadcast_mask(submission, reference, draw):
    """an (L, S) mask broadcast to every batch and head"""
    inputs = broadcast_mask(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_fully_masked_rows(submission, reference, draw):
    """rows with every key masked give weights 0 and output 0"""
    inputs = fully_masked_rows(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(CAUSAL)
def test_causal_mask_square(submission, reference, draw):
    """causal_mask(L) is the lower triangle"""
    inputs = square_causal(draw)
    assert_same(submission.causal_masks(inputs), reference.causal_masks(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(CAUSAL)
def test_causal_mask_rectangular(submission, reference, draw):
    """causal_mask(L, S) is bottom-right aligned"""
    inputs = rectangular_causal(draw)
    assert_same(submission.causal_masks(inputs), reference.causal_masks(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("leading, lengths, dtype", list(SHAPE_CASES.values()), ids=list(SHAPE_CASES))
@pytest.mark.points(0.75)
@pytest.mark.uses(ATTENTION)
def test_random_shapes(submission, reference, draw, leading, lengths, dtype):
    """0 to 3 leading dimensions, L < S, L = S and L > S, d_v != d_k, in float32 and float64"""
    inputs = random_shapes(draw, leading, lengths, dtype)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("shape, rows", list(MASK_CASES.values()), ids=list(MASK_CASES))
@pytest.mark.points(0.75)
@pytest.mark.uses(ATTENTION)
def test_random_masks(submission, reference, draw, shape, rows):
    """masks of every broadcast shape, with and without fully masked rows"""
    inputs = random_masks(draw, shape, rows)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(ATTENTION)
def test_causal_attention(submission, reference, draw):
    """a causal mask with more queries than keys"""
    inputs = causal_attention(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_gradients(submission, reference, draw):
    """gradients with respect to q, k and v, finite and right through fully masked rows"""
    inputs = gradient_inputs(draw)
    assert_same(submission.gradients(inputs), reference.gradients(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(ATTENTION)
def test_float64_precision(submission, reference, draw):
    """float64 inputs computed in float64 throughout (no float32 scores or softmax)"""
    inputs = float64_inputs(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(CAUSAL)
def test_causal_mask_random(submission, reference, draw):
    """causal_mask for random L < S, L = S, L > S and S left to its default, with and without a device"""
    inputs = random_causal(draw)
    assert_same(submission.causal_masks(inputs), reference.causal_masks(inputs), inputs)
