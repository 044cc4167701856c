"""`sdpa`: scaled dot-product attention and the bottom-right aligned causal mask.

The tests of the exercise: each draws its inputs, makes the same calls on the learner's
functions (`submission`) and on the course's solution (`reference`, float64), and holds one
against the other. Run them on a notebook with
`pytest autograde/tests/test_sdpa.py --notebook path/to/sdpa.ipynb [--seed N]`.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import NOT_ALLOWED_ATTENTION, Draw, Exercise, Inputs
from autograde.sandbox.observe import pair
from autograde.testing import adapter, assert_same, returned_pair

ATTENTION = "scaled_dot_product_attention"
CAUSAL = "causal_mask"


def random_mask(draw: Draw, shape: tuple[int, ...], empty_rows: int = 0) -> tuple[torch.Tensor, str]:
    """A bool mask (True = may attend) in which exactly `empty_rows` rows attend nothing, and a note."""
    mask = draw.bernoulli(*shape, p=0.6)
    rows = mask.view(-1, shape[-1])
    for row in rows:  # every row keeps at least one key, unless chosen to be empty below
        row[draw.integer(0, shape[-1] - 1)] = True
    emptied = draw.py.sample(range(rows.shape[0]), empty_rows)
    rows[emptied] = False
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


@adapter
def attend(functions, inputs: Inputs) -> dict:
    mask = {"mask": inputs["mask"]} if "mask" in inputs.values else {}
    call = "scaled_dot_product_attention(q, k, v" + (", mask=mask)" if mask else ")")
    out, weights = pair(functions.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], **mask), call)
    return {"out": out, "weights": weights}


@adapter
def causal_masks(functions, inputs: Inputs) -> dict:
    return {
        f"causal_mask({', '.join(map(repr, args))})": functions.causal_mask(*args)
        for args in inputs["calls"]
    }


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


# Inputs of the hidden tests: shapes, dtypes and masks drawn from the instructor's seed.

def random_shapes(draw: Draw) -> Inputs:
    lead = (draw.integer(1, 3),) if draw.integer(0, 1) else (draw.integer(1, 3), draw.integer(1, 4))
    dtype = draw.choice([torch.float32, torch.float64])
    values = qkv(draw, lead, L=draw.integer(1, 9), S=draw.integer(1, 9),
                 d_k=draw.integer(1, 16), d_v=draw.integer(1, 16), dtype=dtype, scale=draw.choice([0.5, 1.0, 3.0]))
    return Inputs(values, "no mask, random sizes")


def random_masks(draw: Draw) -> Inputs:
    B, H, L, S = draw.integer(1, 3), draw.integer(1, 4), draw.integer(2, 8), draw.integer(2, 8)
    values = qkv(draw, (B, H), L=L, S=S, d_k=draw.integer(2, 12), d_v=draw.integer(1, 12),
                 dtype=draw.choice([torch.float32, torch.float64]))
    shape = draw.choice([(L, S), (B, 1, L, S), (B, H, L, S), (1, H, L, S)])
    values["mask"], note = random_mask(draw, shape, empty_rows=draw.integer(1, 2))
    return Inputs(values, f"random mask, {note}")


def causal_attention(draw: Draw) -> Inputs:
    S = draw.integer(1, 6)
    L = S + draw.integer(1, 4)
    values = qkv(draw, (draw.integer(1, 3), draw.integer(1, 3)), L=L, S=S, d_k=8, d_v=8, dtype=torch.float64)
    values["mask"] = bottom_right_causal(L, S)
    return Inputs(values, f"causal mask with L > S: the first {plural(L - S, 'row')} attend nothing")


def random_causal(draw: Draw) -> Inputs:
    calls = [(draw.integer(1, 12), draw.integer(1, 12)) for _ in range(4)] + [(draw.integer(1, 12),)]
    return Inputs({"calls": calls}, "random L and S")


EXERCISE = Exercise(
    id="sdpa",
    assignment="attention",
    title="Scaled dot-product attention",
    required=(ATTENTION, CAUSAL),
    not_allowed=NOT_ALLOWED_ATTENTION,
)


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
@pytest.mark.points(1.5)
@pytest.mark.uses(ATTENTION)
def test_random_shapes(submission, reference, draw):
    """random batch shapes, sizes and dtypes"""
    inputs = random_shapes(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_random_masks(submission, reference, draw):
    """random broadcast masks with fully masked rows"""
    inputs = random_masks(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_causal_attention(submission, reference, draw):
    """a causal mask with more queries than keys"""
    inputs = causal_attention(draw)
    assert_same(submission.attend(inputs), reference.attend(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(CAUSAL)
def test_causal_mask_random(submission, reference, draw):
    """causal_mask for random L and S"""
    inputs = random_causal(draw)
    assert_same(submission.causal_masks(inputs), reference.causal_masks(inputs), inputs)
