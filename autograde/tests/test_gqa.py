"""`gqa`: repeat_kv, the GroupedQueryAttention module, converting MHA weights to GQA, the size of a KV cache.

The hidden tests are parametrised by the axes along which the contract lets inputs vary, so that
every graded run covers every value of each; the seed draws only sizes and values:
repeat_kv's `n_rep` (1, or more; on one and on several key/value heads); the module's layout
(MHA, GQA, MQA), biases (on, off) and mask (none, (T, T), (B, 1, T, T), (B, H, T, T)), each case
in float32 or float64 (every value of every axis meets both); mha_to_gqa's biases and the layout
converted to; kv_cache_bytes with
`bytes_per_element` left to its default or given.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.gqa import (
    BYTES,
    CONVERT,
    MODULE,
    REPEAT,
    projection_shapes,
)
from autograde.testing import assert_same
from autograde.tests.test_sdpa import bottom_right_causal, random_mask

# Pairs (num_heads, num_kv_heads) with 1 < num_kv_heads < num_heads: neither MHA nor MQA.
GROUPED = [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (12, 4)]
# (num_layers, num_kv_heads, head_dim) of LLaMA-2 7B (MHA), LLaMA-2 70B (GQA-8) and PaLM 540B (MQA).
REAL_MODELS = [(32, 32, 128), (80, 8, 128), (118, 1, 256)]

# The axes of the hidden tests (their values are the test ids).
LAYOUTS = ("MHA (a KV head per query head)", "GQA (a KV head per group of query heads)", "MQA (1 KV head)")
BIASES = {"with biases": True, "without biases": False}
MASKS = ("no mask", "mask (T, T)", "mask (B, 1, T, T)", "mask (B, H, T, T)")
REPEATS = ("n_rep 1", "n_rep 2 or more")
ELEMENT_SIZES = ("bytes_per_element by default", "bytes_per_element given")
ATTENTION_CASES = alternate_dtypes({f"{layout}, {bias}, {mask}": (layout, bias, mask)
                                    for layout in LAYOUTS for bias in BIASES for mask in MASKS})
CONVERSION_CASES = alternate_dtypes({f"to {layout}, {bias}": (layout, bias) for layout in LAYOUTS for bias in BIASES})


def projection_weights(draw: Draw, d_model: int, num_heads: int, num_kv_heads: int, bias: bool, dtype) -> dict:
    """Seeded weights (and biases) of the four projections, keyed as in a state dict."""
    values = {}
    for name, (in_features, out_features) in projection_shapes(d_model, num_heads, num_kv_heads).items():
        values[f"{name}.weight"] = draw.normal(out_features, in_features, dtype=dtype, scale=in_features ** -0.5)
        if bias:
            values[f"{name}.bias"] = draw.normal(out_features, dtype=dtype, scale=in_features ** -0.5)
    return values


def layout_heads(draw: Draw, layout: str) -> tuple[int, int]:
    """(num_heads, num_kv_heads) of a layout of `LAYOUTS`; MHA and MQA with 2 or more query heads."""
    kind = layout.split()[0]
    if kind == "MHA":
        heads = draw.choice([2, 3, 4])
        return heads, heads
    if kind == "MQA":
        return draw.choice([2, 4, 8]), 1
    return draw.choice(GROUPED)


def module_inputs(x: torch.Tensor, d_model: int, num_heads: int, num_kv_heads: int, bias: bool, weights: dict) -> dict:
    return {"x": x, "d_model": d_model, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "bias": bias,
            **weights}


# Visible cases.

def repeat_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 3, 4, 5), "one_head": draw.normal(1, 1, 3, 2),
                   "calls": [("x", 1), ("x", 2), ("x", 4), ("one_head", 3)]},
                  "x has 3 key/value heads, one_head has 1")


def structure_inputs(draw: Draw) -> Inputs:
    return Inputs({"d_model": 16, "num_heads": 4, "num_kv_heads": 2})


def value_error_inputs(draw: Draw) -> Inputs:
    return Inputs({"calls": [(10, 4, 2), (16, 4, 3), (16, 4, 8), (16, 4, 1), (16, 4, 4)]},
                  "d_model % num_heads or num_heads % num_kv_heads not 0 raises; MQA and MHA do not")


def grouped_inputs(draw: Draw) -> Inputs:
    dtype = torch.float64
    values = module_inputs(draw.normal(2, 5, 16, dtype=dtype), 16, 4, 2, True,
                           projection_weights(draw, 16, 4, 2, True, dtype))
    values["mask"] = bottom_right_causal(5, 5)
    return Inputs(values, "4 query heads in 2 groups, given projection weights, causal mask")


def mha_state_dict(draw: Draw, d_model: int, bias: bool, dtype) -> dict:
    """The state dict of an MHA layer (num_kv_heads == num_heads)."""
    return projection_weights(draw, d_model, 1, 1, bias, dtype)


def conversion_inputs(draw: Draw) -> Inputs:
    return Inputs({**mha_state_dict(draw, 16, True, torch.float64), "num_heads": 4, "num_kv_heads": [2, 1]},
                  "the state dict of an MHA layer with d_model=16, with biases")


def callers_state_dict_inputs(draw: Draw, bias: bool) -> Inputs:
    return Inputs({**mha_state_dict(draw, 16, bias, torch.float64), "num_heads": 4, "num_kv_heads": [1, 2, 4]},
                  f"the state dict of an MHA layer with d_model=16, {'with' if bias else 'without'} biases, "
                  "converted to MQA, GQA and MHA")


def cache_bytes_inputs(draw: Draw) -> Inputs:
    calls = [((*model, 4096, 1), None) for model in REAL_MODELS]
    calls += [((80, 8, 128, 4096, 8), 4), ((32, 32, 128, 1, 1), 1)]
    return Inputs({"calls": calls}, "LLaMA-2 7B, LLaMA-2 70B and PaLM 540B; float32 and int8 caches")


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def repeat_random_inputs(draw: Draw, repeat: str) -> Inputs:
    n_rep = 1 if repeat == "n_rep 1" else draw.integer(2, 4)
    B, S, d = draw.integer(1, 3), draw.integer(1, 6), draw.integer(1, 6)
    return Inputs({"x": draw.normal(B, draw.integer(2, 4), S, d), "one_head": draw.normal(B, 1, S, d),
                   "calls": [("x", n_rep), ("one_head", n_rep)]},
                  "x has several key/value heads, one_head has 1")


def attention_random_inputs(draw: Draw, layout: str, bias: bool, mask: str) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    num_heads, num_kv_heads = layout_heads(draw, layout)
    d_model, dtype = num_heads * draw.integer(1, 3), torch.float64
    B, T = draw.integer(2, 3), draw.integer(2, 7)
    values = module_inputs(draw.normal(B, T, d_model, dtype=dtype), d_model, num_heads, num_kv_heads, bias,
                           projection_weights(draw, d_model, num_heads, num_kv_heads, bias, dtype))
    note = f"{num_heads} query heads, {num_kv_heads} key/value heads, {'with' if bias else 'without'} biases"
    if mask != "no mask":
        shape = {"mask (T, T)": (T, T), "mask (B, 1, T, T)": (B, 1, T, T), "mask (B, H, T, T)": (B, num_heads, T, T)}
        values["mask"], masked = random_mask(draw, shape[mask], empty_rows=1)
        note += f", {mask} with {masked}"
    return Inputs(values, note)


def conversion_random_inputs(draw: Draw, layout: str, bias: bool) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    num_heads, num_kv_heads = layout_heads(draw, layout)
    d_model = num_heads * draw.integer(1, 4)
    return Inputs({**mha_state_dict(draw, d_model, bias, torch.float64), "num_heads": num_heads,
                   "num_kv_heads": [num_kv_heads]},
                  f"the state dict of an MHA layer with d_model={d_model}, {'with' if bias else 'without'} biases")


def cache_bytes_random_inputs(draw: Draw, element_size: str) -> Inputs:
    sizes = (None,) * 3 if element_size == "bytes_per_element by default" else (1, 2, 4)
    calls = [((draw.integer(1, 96), draw.choice([1, 2, 4, 8, 16, 32]), draw.choice([64, 80, 96, 128, 256]),
               draw.integer(1, 2**17), draw.integer(1, 64)), bytes_per_element)
             for bytes_per_element in sizes]
    return Inputs({"calls": calls}, "random configurations")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(REPEAT)
def test_repeat_kv(submission, reference, draw):
    """output head j is input head j // n_rep"""
    inputs = repeat_inputs(draw)
    got, expected = submission.repeats(inputs), reference.repeats(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_module_structure(submission, reference, draw):
    """projections of the contract's shapes, num_heads, num_kv_heads, head_dim"""
    inputs = structure_inputs(draw)
    got, expected = submission.structure(inputs), reference.structure(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(MODULE)
def test_value_errors(submission, reference, draw):
    """ValueError when d_model % num_heads or num_heads % num_kv_heads is not 0"""
    inputs = value_error_inputs(draw)
    got, expected = submission.value_errors(inputs), reference.value_errors(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_grouped_attention(submission, reference, draw):
    """outputs of grouped-query self-attention with a causal mask"""
    inputs = grouped_inputs(draw)
    got, expected = submission.attention(inputs), reference.attention(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(CONVERT)
def test_mha_to_gqa(submission, reference, draw):
    """K and V heads mean-pooled per group, weights and biases; Q and O copied"""
    inputs = conversion_inputs(draw)
    got, expected = submission.converted(inputs), reference.converted(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.parametrize("bias", list(BIASES.values()), ids=list(BIASES))
@pytest.mark.points(0.5)
@pytest.mark.uses(CONVERT)
def test_mha_to_gqa_leaves_state_dict_unchanged(submission, reference, draw, bias):
    """mha_to_gqa returns a new dict and leaves the state dict it was given unchanged"""
    inputs = callers_state_dict_inputs(draw, bias)
    got, expected = submission.callers_state_dict(inputs), reference.callers_state_dict(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(BYTES)
def test_kv_cache_bytes(submission, reference, draw):
    """the cache of real models, in bytes"""
    inputs = cache_bytes_inputs(draw)
    got, expected = submission.cache_sizes(inputs), reference.cache_sizes(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("repeat", REPEATS, ids=REPEATS)
@pytest.mark.points(0.5)
@pytest.mark.uses(REPEAT)
def test_repeat_kv_random(submission, reference, draw, repeat):
    """random sizes, on one and on several key/value heads"""
    inputs = repeat_random_inputs(draw, repeat)
    got, expected = submission.repeats(inputs), reference.repeats(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("layout, bias, mask, dtype", list(ATTENTION_CASES.values()), ids=list(ATTENTION_CASES))
@pytest.mark.points(3.0)
@pytest.mark.uses(MODULE)
def test_attention_random(submission, reference, draw, layout, bias, mask, dtype):
    """every layout, with and without biases, under every kind of mask, in float32 or float64"""
    drawn = attention_random_inputs(draw, layout, BIASES[bias], mask)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.attention(inputs), reference.attention(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("layout, bias, dtype", list(CONVERSION_CASES.values()), ids=list(CONVERSION_CASES))
@pytest.mark.points(0.75)
@pytest.mark.uses(CONVERT)
def test_mha_to_gqa_random(submission, reference, draw, layout, bias, dtype):
    """conversions to MHA, GQA and MQA, with and without biases, in float32 or float64"""
    drawn = conversion_random_inputs(draw, layout, BIASES[bias])
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.converted(inputs), reference.converted(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("element_size", ELEMENT_SIZES, ids=ELEMENT_SIZES)
@pytest.mark.points(0.75)
@pytest.mark.uses(BYTES)
def test_kv_cache_bytes_random(submission, reference, draw, element_size):
    """random configurations, bytes_per_element by default and given"""
    inputs = cache_bytes_random_inputs(draw, element_size)
    got, expected = submission.cache_sizes(inputs), reference.cache_sizes(inputs)
    assert_same(got, expected, inputs)
