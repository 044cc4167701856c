"""`split_kv`: split-KV decoding (FlashDecoding): merging the attention of two key sets, and attention
computed over chunks of keys and merged.

Both the merged result and each chunk's partial result are graded, so the chunking itself is: chunks of
ceil(S / num_splits) keys, the last ones shorter or empty. The hidden tests are parametrised by the
contract's axes, so that every graded run covers every value of each: for the merge, logsumexps of
ordinary and of large magnitudes (past where exp overflows or underflows) in float32 and float64; for
the attention, one split, splits that divide S, splits that do not, more splits than keys (empty
chunks), one query (decoding) and several, causal or not, and the MHA, GQA and MQA layouts, each case in
float32 or float64 (every value of every axis meets both), plus scores large enough that a merge
without the maximum overflows.
"""

from __future__ import annotations

import math

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.split_kv import MERGE, SPLIT
from autograde.testing import assert_same
from autograde.tests.test_gqa import LAYOUTS, layout_heads

# The axes of the hidden tests (their values are the test ids).
DTYPES = {"float32": torch.float32, "float64": torch.float64}
MAGNITUDES = ("ordinary lse", "large positive lse", "large negative lse")
MERGE_CASES = {f"{magnitude}, {dtype}": (magnitude, dtype) for magnitude in MAGNITUDES for dtype in DTYPES}
SPLITS = ("one split", "splits dividing S", "splits not dividing S", "more splits than keys")
QUERIES = ("L = 1 (decoding)", "L > 1")
CAUSAL = {"not causal": False, "causal (bottom-right)": True}
SPLIT_CASES = alternate_dtypes({f"{splits}, {queries}, {causal}, {layout}": (splits, queries, causal, layout)
                                for splits in SPLITS for queries in QUERIES for causal in CAUSAL for layout in LAYOUTS})
# |lse| past where exp overflows (88.7 in float32, 709.8 in float64) and underflows to 0 (-103.3 and
# -744.4), yet small enough that float32 holds exp(lse_a - lse) to a few parts in a million (its spacing
# below 128 is 7.6e-6).
LARGE_LSE = {torch.float32: (105.0, 120.0), torch.float64: (800.0, 1000.0)}
# Scores shifted by a constant: each (scores of the exact form integer / 4, so float32 computes them exactly).
LARGE_SCORE_SHIFT = {torch.float32: (32.0, 12.0), torch.float64: (64.0, 62.5)}  # q[..., 0], k[..., 0]: 96, 1000


# Inputs.

def states(draw: Draw, shape: tuple[int, ...], dtype, low: float = -3.0, high: float = 3.0) -> dict:
    """Two states of `shape` (..., L, d): outs and lses, the lses uniform in [low, high]."""
    values = {}
    for side in ("a", "b"):
        values[f"out_{side}"] = draw.normal(*shape, dtype=dtype)
        values[f"lse_{side}"] = (low + (high - low) * torch.rand(shape[:-1], generator=draw.generator,
                                                                  dtype=torch.float64)).to(dtype)
    return values


def emptied(draw: Draw, values: dict, rows: int) -> dict:
    """Set the lse of one side (a or b, drawn) to -inf in `rows` rows; that side's out keeps finite values."""
    lse_a, lse_b = values["lse_a"].view(-1).clone(), values["lse_b"].view(-1).clone()
    for row in draw.py.sample(range(lse_a.numel()), rows):
        (lse_a if draw.integer(0, 1) else lse_b)[row] = -math.inf
    return {**values, "lse_a": lse_a.view(values["lse_a"].shape), "lse_b": lse_b.view(values["lse_b"].shape)}


def attention_inputs(draw: Draw, B: int, H: int, H_kv: int, L: int, lengths: dict[str, int], d: int, dtype) -> dict:
    """q (B, H, L, d) and, for each tag, keys and values (B, H_kv, S, d) with S = lengths[tag]."""
    values = {"q": draw.normal(B, H, L, d, dtype=dtype)}
    for tag, S in lengths.items():
        values[f"k{tag}"], values[f"v{tag}"] = draw.normal(B, H_kv, S, d, dtype=dtype), draw.normal(B, H_kv, S, d,
                                                                                                   dtype=dtype)
    return values


def heads_text(H: int, H_kv: int) -> str:
    return f"{H} query heads, {H_kv} key/value head{'s' if H_kv > 1 else ''}"


# Visible cases.

def two_states_inputs(draw: Draw) -> Inputs:
    values = {**states(draw, (2, 3, 4, 8), torch.float64)}
    values.update({f"{name}_2d": value for name, value in states(draw, (5, 8), torch.float64).items()})
    return Inputs({**values, "tags": ["", "_2d"]}, "finite lses; states (B, H, L, d) and (L, d)")


def empty_sides_inputs(draw: Draw) -> Inputs:
    values = states(draw, (2, 2, 6, 8), torch.float32)
    lse_a, lse_b = values["lse_a"].clone(), values["lse_b"].clone()
    lse_a[:, :, 0], lse_b[:, :, 1] = -math.inf, -math.inf
    lse_a[:, :, 2], lse_b[:, :, 2] = -math.inf, -math.inf
    return Inputs({**values, "lse_a": lse_a, "lse_b": lse_b, "tags": [""]},
                  "row 0: side a empty (lse -inf), row 1: side b empty, row 2: both; the outs of empty sides "
                  "hold finite values that must not count")


def large_lse_inputs(draw: Draw) -> Inputs:
    low, high = LARGE_LSE[torch.float32]
    values = states(draw, (2, 3, 5, 8), torch.float32, low, high)
    values.update({f"{name}_neg": value for name, value in states(draw, (2, 3, 5, 8), torch.float32, -high,
                                                                  -low).items()})
    return Inputs({**values, "tags": ["", "_neg"]},
                  f"float32 lses in [{low:g}, {high:g}] and in [{-high:g}, {-low:g}], where exp overflows "
                  "and underflows")


def decode_inputs(draw: Draw) -> Inputs:
    values = attention_inputs(draw, 2, 4, 2, 1, {"": 37}, 16, torch.float64)
    return Inputs({**values, "calls": [("", 4, False), ("", 4, True)]},
                  f"one query per sequence, {heads_text(4, 2)}, 37 keys in 4 splits")


def causal_inputs(draw: Draw) -> Inputs:
    values = attention_inputs(draw, 2, 3, 3, 5, {"": 24}, 8, torch.float32)
    return Inputs({**values, "calls": [("", 3, True)]},
                  f"5 queries, 24 keys in 3 splits, causal (bottom-right), {heads_text(3, 3)}")


def empty_chunks_inputs(draw: Draw) -> Inputs:
    values = attention_inputs(draw, 2, 3, 1, 2, {"": 10, "_short": 3}, 8, torch.float64)
    return Inputs({**values, "calls": [("", 6, False), ("_short", 5, False)]},
                  f"10 keys in 6 splits and 3 keys in 5 splits: empty last chunks; {heads_text(3, 1)}")


def rows_attending_nothing_inputs(draw: Draw) -> Inputs:
    values = attention_inputs(draw, 1, 2, 2, 7, {"": 5}, 8, torch.float64)
    return Inputs({**values, "calls": [("", 2, True)]},
                  "causal with L = 7 > S = 5: the first 2 rows attend nothing (out 0, lse -inf)")


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def merge_random_inputs(draw: Draw, magnitude: str, dtype: torch.dtype) -> Inputs:
    low, high = {"ordinary lse": (-5.0, 5.0), "large positive lse": LARGE_LSE[dtype],
                 "large negative lse": tuple(-x for x in reversed(LARGE_LSE[dtype]))}[magnitude]
    lead = tuple(draw.integer(1, 3) for _ in range(draw.integer(0, 2)))
    shape = (*lead, draw.integer(1, 6), draw.choice([4, 8, 16]))
    values = states(draw, shape, dtype, low, high)
    rows = math.prod(shape[:-1])
    values = emptied(draw, values, draw.integer(0, rows // 2))
    return Inputs({**values, "tags": [""]}, f"{magnitude}, some rows with one side empty")


def ragged_splits(draw: Draw, low: int, high: int) -> tuple[int, int]:
    """(S, num_splits) with 2 <= num_splits <= S, S not a multiple of num_splits, and no empty chunk."""
    while True:
        S = draw.integer(low, high)
        options = [n for n in range(2, S + 1) if S % n and (n - 1) * math.ceil(S / n) < S]
        if options:
            return S, draw.choice(options)


def split_sizes(draw: Draw, splits: str) -> tuple[int, int]:
    """(S, num_splits) for a value of the SPLITS axis, with S >= 3."""
    if splits == "one split":
        return draw.integer(3, 40), 1
    if splits == "splits dividing S":
        num_splits = draw.integer(2, 6)
        return num_splits * draw.integer(2 if num_splits == 2 else 1, 8), num_splits
    if splits == "splits not dividing S":
        return ragged_splits(draw, 5, 40)
    S = draw.integer(3, 6)
    return S, S + draw.integer(1, 4)


def split_random_inputs(draw: Draw, splits: str, queries: str, causal: bool, layout: str) -> Inputs:
    """In float64; the test casts them to its case's dtype. 1 <= L < S: every row attends a key, and a causal mask
    aligned top-left would differ."""
    H, H_kv = layout_heads(draw, layout)
    S, num_splits = split_sizes(draw, splits)
    L = 1 if queries == "L = 1 (decoding)" else draw.integer(2, min(S - 1, 6))
    values = attention_inputs(draw, draw.integer(1, 2), H, H_kv, L, {"": S}, draw.choice([4, 8, 16]), torch.float64)
    return Inputs({**values, "calls": [("", num_splits, causal)]}, heads_text(H, H_kv))


def large_scores_inputs(draw: Draw, dtype: torch.dtype) -> Inputs:
    """Scores near 96 (float32) or 1000 (float64), each exactly representable: integer / 4 with d = 16."""
    B, H, H_kv, d = 2, 4, 2, 16
    S, num_splits = ragged_splits(draw, 9, 40)
    L = draw.integer(1, 4)
    q_shift, k_shift = LARGE_SCORE_SHIFT[dtype]
    small = lambda *shape: torch.randint(-1, 2, shape, generator=draw.generator).to(dtype)  # noqa: E731
    q, k = small(B, H, L, d), small(B, H_kv, S, d)
    q[..., 0], k[..., 0] = q_shift, k_shift
    values = {"q": q, "k": k, "v": draw.normal(B, H_kv, S, d, dtype=dtype)}
    return Inputs({**values, "calls": [("", num_splits, False), ("", num_splits, True)]},
                  f"scores near {q_shift * k_shift / 4:g}, where exp overflows; {heads_text(H, H_kv)}")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(MERGE)
def test_merge_two_states(submission, reference, draw):
    """out and lse of the union of two key sets, for states of any leading shape"""
    inputs = two_states_inputs(draw)
    assert_same(submission.merges(inputs), reference.merges(inputs), inputs)


@pytest.mark.points(0.75)
@pytest.mark.uses(MERGE)
def test_merge_empty_sides(submission, reference, draw):
    """a side with lse -inf contributes nothing; both give out 0 and lse -inf"""
    inputs = empty_sides_inputs(draw)
    assert_same(submission.merges(inputs), reference.merges(inputs), inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(MERGE)
def test_merge_large_lse(submission, reference, draw):
    """lses past where exp overflows or underflows"""
    inputs = large_lse_inputs(draw)
    assert_same(submission.merges(inputs), reference.merges(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(SPLIT)
def test_split_kv_decode(submission, reference, draw):
    """one query, grouped heads, a ragged last chunk; causal or not"""
    inputs = decode_inputs(draw)
    assert_same(submission.splits(inputs), reference.splits(inputs), inputs)


@pytest.mark.points(0.75)
@pytest.mark.uses(SPLIT)
def test_split_kv_causal(submission, reference, draw):
    """several queries, the causal mask bottom-right aligned, chunks that straddle it"""
    inputs = causal_inputs(draw)
    assert_same(submission.splits(inputs), reference.splits(inputs), inputs)


@pytest.mark.points(0.75)
@pytest.mark.uses(SPLIT)
def test_split_kv_empty_chunks(submission, reference, draw):
    """empty chunks give partial out 0 and lse -inf and change nothing"""
    inputs = empty_chunks_inputs(draw)
    assert_same(submission.splits(inputs), reference.splits(inputs), inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT)
def test_split_kv_rows_attending_nothing(submission, reference, draw):
    """causal with L > S: rows that attend nothing give out 0 and lse -inf"""
    inputs = rows_attending_nothing_inputs(draw)
    assert_same(submission.splits(inputs), reference.splits(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("magnitude, dtype", list(MERGE_CASES.values()), ids=list(MERGE_CASES))
@pytest.mark.points(0.75)
@pytest.mark.uses(MERGE)
def test_merge_random(submission, reference, draw, magnitude, dtype):
    """ordinary and large lses, in float32 and float64, some sides empty"""
    inputs = merge_random_inputs(draw, magnitude, DTYPES[dtype])
    assert_same(submission.merges(inputs), reference.merges(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("splits, queries, causal, layout, dtype", list(SPLIT_CASES.values()), ids=list(SPLIT_CASES))
@pytest.mark.points(3.0)
@pytest.mark.uses(SPLIT)
def test_split_kv_random(submission, reference, draw, splits, queries, causal, layout, dtype):
    """every kind of chunking, one query and several, causal or not, every layout, in float32 or float64"""
    drawn = split_random_inputs(draw, splits, queries, CAUSAL[causal], layout)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    assert_same(submission.splits(inputs), reference.splits(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.points(1.0)
@pytest.mark.uses(SPLIT)
def test_split_kv_large_scores(submission, reference, draw, dtype):
    """scores whose logsumexps overflow exp, causal or not"""
    inputs = large_scores_inputs(draw, DTYPES[dtype])
    assert_same(submission.splits(inputs), reference.splits(inputs), inputs)
