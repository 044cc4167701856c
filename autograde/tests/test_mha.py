"""`mha`: splitting and merging heads, the MultiHeadAttention module, loading nn.MultiheadAttention.

The hidden tests are parametrised by the axes along which the contract lets inputs vary, so that
every graded run covers every value of each; the seed draws only sizes and values:
self- and cross-attention, masks (none, (L, S), (B, 1, L, S), (B, H, L, S)), biases (on, off)
and heads (1, several), each case in float32 or float64 (every value of every axis meets
both); `key` and `value` left to their
defaults; loading an nn.MultiheadAttention with 1 head and several. Outputs are compared in
eval() mode; one test holds train() mode to the same output (the contract has no dropout), and
one the gradients through fully masked rows.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.mha import (
    LOAD,
    MERGE,
    MODULE,
    PROJECTIONS,
    SPLIT,
)
from autograde.testing import assert_same
from autograde.tests.test_sdpa import random_mask

# The axes of the hidden tests (their values are the test ids).
KINDS = ("self-attention", "cross-attention")
MASKS = ("no mask", "mask (L, S)", "mask (B, 1, L, S)", "mask (B, H, L, S)")
BIASES = {"with biases": True, "without biases": False}
HEADS = ("1 head", "several heads")
ATTENTION_CASES = alternate_dtypes({f"{kind}, {mask}, {bias}, {heads}": (kind, mask, bias, heads)
                                    for kind in KINDS for mask in MASKS for bias in BIASES for heads in HEADS})
DEFAULTS = ("key and value left to their defaults", "value left to its default")


# Inputs.

def projection_weights(draw: Draw, d_model: int, bias: bool, dtype) -> dict:
    scale = d_model ** -0.5
    values = {}
    for name in PROJECTIONS:
        values[f"{name}.weight"] = draw.normal(d_model, d_model, dtype=dtype, scale=scale)
        if bias:
            values[f"{name}.bias"] = draw.normal(d_model, dtype=dtype, scale=scale)
    return values


def torch_mha_weights(draw: Draw, d_model: int, bias: bool, dtype) -> dict:
    scale = d_model ** -0.5
    values = {"in_proj_weight": draw.normal(3 * d_model, d_model, dtype=dtype, scale=scale),
              "out_proj.weight": draw.normal(d_model, d_model, dtype=dtype, scale=scale)}
    if bias:
        values["in_proj_bias"] = draw.normal(3 * d_model, dtype=dtype, scale=scale)
        values["out_proj.bias"] = draw.normal(d_model, dtype=dtype, scale=scale)
    return values


def sequences(draw: Draw, B: int, L: int, S: int, d_model: int, dtype, cross: bool = True) -> dict:
    query = draw.normal(B, L, d_model, dtype=dtype)
    if not cross:
        return {"query": query, "key": query, "value": query}
    return {"query": query, "key": draw.normal(B, S, d_model, dtype=dtype),
            "value": draw.normal(B, S, d_model, dtype=dtype)}


def module_inputs(sequence_values: dict, d_model: int, num_heads: int, bias: bool, weights: dict) -> dict:
    return {**sequence_values, "d_model": d_model, "num_heads": num_heads, "bias": bias, **weights}


def head_count(draw: Draw, heads: str) -> int:
    return 1 if heads == "1 head" else draw.integer(2, 4)


def split_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 5, 12), "num_heads": [3, 1, 12]})


def round_trip_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 5, 12), "y": draw.normal(2, 3, 5, 4), "num_heads": [4, 6]})


def indivisible_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 5, 10), "num_heads": [3, 4]})


def structure_inputs(draw: Draw) -> Inputs:
    return Inputs({"d_model": 16, "num_heads": 4, "indivisible": [(10, 3), (16, 5)]})


def self_attention_inputs(draw: Draw) -> Inputs:
    dtype = torch.float64
    values = sequences(draw, B=2, L=5, S=5, d_model=16, dtype=dtype, cross=False)
    return Inputs(module_inputs(values, 16, 4, True, projection_weights(draw, 16, True, dtype)),
                  "self-attention (query = key = value), given projection weights, no mask")


def load_cross_inputs(draw: Draw) -> Inputs:
    dtype = torch.float32
    values = sequences(draw, B=2, L=4, S=6, d_model=12, dtype=dtype)
    return Inputs(module_inputs(values, 12, 3, True, torch_mha_weights(draw, 12, True, dtype)),
                  "weights of an nn.MultiheadAttention(12, 3, bias=True), cross-attention")


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed. Batch and
# lengths are at least 2, so that (B, 1, L, S) is not (L, S) and heads mixed with tokens show.

def attention_random_inputs(draw: Draw, kind: str, mask: str, bias: bool, heads: str) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    num_heads, dtype = head_count(draw, heads), torch.float64
    d_model = num_heads * draw.integer(2, 4)
    B, L = draw.integer(2, 3), draw.integer(2, 6)
    S = L if kind == "self-attention" else draw.integer(2, 6)
    values = module_inputs(sequences(draw, B, L, S, d_model, dtype, cross=kind == "cross-attention"),
                           d_model, num_heads, bias, projection_weights(draw, d_model, bias, dtype))
    note = f"{kind}, given projection weights, {'with' if bias else 'without'} biases"
    if mask != "no mask":
        shape = {"mask (L, S)": (L, S), "mask (B, 1, L, S)": (B, 1, L, S), "mask (B, H, L, S)": (B, num_heads, L, S)}
        values["mask"], masked = random_mask(draw, shape[mask], empty_rows=1)
        note += f", {mask} with {masked}"
    return Inputs(values, note)


def defaults_inputs(draw: Draw, defaulted: str) -> Inputs:
    num_heads = draw.integer(2, 4)
    d_model, dtype = num_heads * draw.integer(2, 4), torch.float64
    values = sequences(draw, draw.integer(2, 3), draw.integer(2, 6), draw.integer(2, 6), d_model, dtype)
    del values["value"]
    if defaulted == "key and value left to their defaults":
        del values["key"]
    return Inputs(module_inputs(values, d_model, num_heads, True, projection_weights(draw, d_model, True, dtype)),
                  f"given projection weights; {defaulted}")


def load_no_bias_inputs(draw: Draw, heads: str) -> Inputs:
    num_heads = head_count(draw, heads)
    d_model, dtype = num_heads * draw.integer(2, 4), torch.float64
    values = sequences(draw, draw.integer(2, 3), draw.integer(2, 6), draw.integer(2, 6), d_model, dtype)
    return Inputs(module_inputs(values, d_model, num_heads, False, torch_mha_weights(draw, d_model, False, dtype)),
                  f"weights of an nn.MultiheadAttention(d_model, {num_heads}, bias=False), cross-attention")


def random_heads_inputs(draw: Draw, heads: str) -> Inputs:
    num_heads, head_dim = (1, draw.integer(2, 6)) if heads == "1 head" else (draw.integer(2, 6), draw.integer(1, 5))
    x = draw.normal(draw.integer(1, 3), draw.integer(2, 7), num_heads * head_dim)
    y = draw.normal(draw.integer(1, 3), num_heads, draw.integer(2, 7), head_dim)
    return Inputs({"x": x, "y": y, "num_heads": [num_heads]})


def train_and_eval_inputs(draw: Draw) -> Inputs:
    """Large enough (192 outputs) that a dropout keeps every one of them with a negligible chance."""
    dtype = torch.float64
    values = sequences(draw, B=2, L=6, S=6, d_model=16, dtype=dtype, cross=False)
    return Inputs(module_inputs(values, 16, 4, True, projection_weights(draw, 16, True, dtype)),
                  "self-attention, given projection weights, no mask")


def gradient_inputs(draw: Draw) -> Inputs:
    num_heads = draw.integer(2, 4)
    d_model, dtype = num_heads * draw.integer(2, 4), torch.float64
    B, L, S = draw.integer(2, 3), draw.integer(3, 6), draw.integer(2, 6)
    values = module_inputs(sequences(draw, B, L, S, d_model, dtype), d_model, num_heads, True,
                           projection_weights(draw, d_model, True, dtype))
    values["mask"], masked = random_mask(draw, (L, S), empty_rows=draw.integer(1, 2))
    values["dout"] = draw.normal(B, L, d_model)
    return Inputs(values, f"cross-attention, given projection weights, mask (L, S) with {masked}; "
                          "gradients of (out * dout).sum()")


# The tests.

@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT)
def test_split_heads(submission, reference, draw):
    """(B, T, H*d) -> (B, H, T, d), head h holding features h*d to (h+1)*d"""
    inputs = split_inputs(draw)
    got, expected = submission.heads(inputs), reference.heads(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT, MERGE)
def test_merge_heads(submission, reference, draw):
    """merge_heads undoes split_heads"""
    inputs = round_trip_inputs(draw)
    got, expected = submission.round_trip(inputs), reference.round_trip(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT)
def test_split_heads_value_error(submission, reference, draw):
    """ValueError when the width is not divisible by the heads"""
    inputs = indivisible_inputs(draw)
    got, expected = submission.indivisible(inputs), reference.indivisible(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_module_structure(submission, reference, draw):
    """q_proj, k_proj, v_proj, o_proj and the ValueError"""
    inputs = structure_inputs(draw)
    got, expected = submission.structure(inputs), reference.structure(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE)
def test_self_attention(submission, reference, draw):
    """outputs and per-head weights of self-attention"""
    inputs = self_attention_inputs(draw)
    got, expected = submission.attention(inputs), reference.attention(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE, LOAD)
def test_load_torch_mha(submission, reference, draw):
    """loads nn.MultiheadAttention's packed weights and biases"""
    inputs = load_cross_inputs(draw)
    got, expected = submission.loaded(inputs), reference.loaded(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("kind, mask, bias, heads, dtype", list(ATTENTION_CASES.values()), ids=list(ATTENTION_CASES))
@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE)
def test_attention_random(submission, reference, draw, kind, mask, bias, heads, dtype):
    """self- and cross-attention under every kind of mask, with and without biases, 1 head and several,
    in float32 or float64"""
    drawn = attention_random_inputs(draw, kind, mask, BIASES[bias], heads)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.attention(inputs), reference.attention(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("defaulted", DEFAULTS, ids=DEFAULTS)
@pytest.mark.points(0.5)
@pytest.mark.uses(MODULE)
def test_default_key_value(submission, reference, draw, defaulted):
    """key defaults to query and value to key"""
    inputs = defaults_inputs(draw, defaulted)
    got, expected = submission.defaults(inputs), reference.defaults(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("heads", HEADS, ids=HEADS)
@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE, LOAD)
def test_load_torch_mha_no_bias(submission, reference, draw, heads):
    """loads an nn.MultiheadAttention without biases, with 1 head and several"""
    inputs = load_no_bias_inputs(draw, heads)
    got, expected = submission.loaded(inputs), reference.loaded(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("heads", HEADS, ids=HEADS)
@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT, MERGE)
def test_heads_random(submission, reference, draw, heads):
    """split_heads and merge_heads on random sizes, 1 head and several"""
    inputs = random_heads_inputs(draw, heads)
    got, expected = submission.heads_and_round_trip(inputs), reference.heads_and_round_trip(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(MODULE)
def test_no_dropout(submission, reference, draw):
    """the same output in train() and eval() mode: no dropout"""
    inputs = train_and_eval_inputs(draw)
    got, expected = submission.train_and_eval(inputs), reference.train_and_eval(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(MODULE)
def test_gradients(submission, reference, draw):
    """gradients with respect to the inputs and the projections, finite and right through fully masked rows"""
    inputs = gradient_inputs(draw)
    got, expected = submission.gradients(inputs), reference.gradients(inputs)
    assert_same(got, expected, inputs)
