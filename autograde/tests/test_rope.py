"""`rope`: rotary position embeddings, grouped-query attention that rotates its queries and keys,
and decoding with a cache of rotated keys.

`apply_rope` is graded in both pair layouts, with positions of shape (T,) and broadcast ones,
and with several bases. The decoding step is given a module built here from the case's weights
(plain `nn.Linear` layers, ints and the float `rope_base`, laid out as in the course's
RotaryGroupedQueryAttention), as in `kv_cache`, so that it does not depend on the learner's module.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import Draw, Inputs
from autograde.exercises.rope import (
    DEFAULT_BASE,
    MODULE,
    ROPE,
    STEP,
)
from autograde.testing import assert_same
from autograde.tests.test_gqa import GROUPED, module_inputs, projection_weights
from autograde.tests.test_kv_cache import decoding_inputs, ragged
from autograde.tests.test_sdpa import bottom_right_causal, random_mask

# Bases of real models: 10,000 (the original RoPE, LLaMA-2), 500,000 (LLaMA 3), 1,000,000 (Code Llama),
# and small ones, which turn even the slowest pairs within a few positions.
BASES = (10000.0, 500000.0, 1e6, 500.0, 100.0)
# Widths of the rotated vectors: 2 has a single pair, where the two layouts agree; from 4 on they differ.
WIDTHS = (4, 6, 8, 12, 16, 32)


def positions_tensor(draw: Draw, shape: tuple[int, ...], high: int, dtype=torch.int64, low: int = 0) -> torch.Tensor:
    """Integer positions in [low, high), drawn from the case's generator."""
    return torch.randint(low, high, shape, generator=draw.generator, dtype=torch.int64).to(dtype)


# Visible cases.

def rotation_inputs(draw: Draw, interleaved: bool) -> Inputs:
    layout = {"interleaved": True} if interleaved else {}
    values = {"x": draw.normal(2, 3, 5, 8), "positions": torch.arange(5),
              "y": draw.normal(7, 6), "later": torch.arange(10, 17)}
    calls = [("x", "positions", layout), ("x", "positions", {"base": 500.0, **layout}),
             ("y", "later", {"base": 100.0, **layout})]
    pairs = "(x[..., 2i], x[..., 2i + 1])" if interleaved else "(x[..., i], x[..., i + d/2])"
    return Inputs({**values, "calls": calls},
                  f"pairs {pairs}; x (B, H, T, d) at positions 0 .. T-1, y (T, d) at positions 10 .. 16")


POSITION_SHAPES = ["(T,)", "(B, 1, T)", "(B, H, T)"]


def position_shape_inputs(draw: Draw, shape: str) -> Inputs:
    B, H, T, d = 2, 3, 6, 8
    if shape == "(T,)":
        positions, note = positions_tensor(draw, (T,), 40), "positions (T,) in no particular order, repeats allowed"
    elif shape == "(B, 1, T)":
        offsets = positions_tensor(draw, (B, 1, 1), 30)
        positions, note = offsets + torch.arange(T), "positions (B, 1, T): each sequence starts at its own offset"
    else:
        positions, note = positions_tensor(draw, (B, H, T), 40), "positions (B, H, T): one for every row"
    calls = [("x", "positions", {}), ("x", "positions", {"interleaved": True, "base": 500.0})]
    return Inputs({"x": draw.normal(B, H, T, d), "positions": positions, "calls": calls}, note)


def odd_width_inputs(draw: Draw) -> Inputs:
    return Inputs({"odd": draw.normal(2, 4, 5), "one": draw.normal(3, 1), "even": draw.normal(2, 3, 6),
                   "names": ["odd", "one", "even"]}, "an odd last dimension raises ValueError; an even one does not")


def structure_inputs(draw: Draw) -> Inputs:
    return Inputs({"d_model": 16, "num_heads": 4, "num_kv_heads": 2, "rope_base": 500.0},
                  "with the default base, and with rope_base=500.0")


def value_error_inputs(draw: Draw) -> Inputs:
    return Inputs({"calls": [(10, 4, 2), (16, 4, 3), (16, 4, 8), (16, 4, 1), (16, 4, 4)]},
                  "d_model % num_heads or num_heads % num_kv_heads not 0 raises; MQA and MHA do not")


ATTENTION_CASES = {  # num_heads, num_kv_heads, base (None: the default), dtype
    "MQA, default base": (4, 1, None, torch.float32),
    "GQA, base 500": (4, 2, 500.0, torch.float64),
    "MHA, base 100": (4, 4, 100.0, torch.float64),
}


def rotary_attention_inputs(draw: Draw, case: str) -> Inputs:
    num_heads, num_kv_heads, base, dtype = ATTENTION_CASES[case]
    d_model, T = 32, 6
    values = module_inputs(draw.normal(2, T, d_model, dtype=dtype), d_model, num_heads, num_kv_heads, True,
                           projection_weights(draw, d_model, num_heads, num_kv_heads, True, dtype))
    values["mask"], values["rope_base"] = bottom_right_causal(T, T), base
    return Inputs(values, f"{case}: given projection weights, causal mask, positions 0 .. {T - 1}")


def rotary_decoding_inputs(draw: Draw, B: int, length: int, d_model: int, num_heads: int, num_kv_heads: int,
                           bias: bool, dtype, chunkings: list[list[int]], base: float,
                           cached: int | None = None) -> dict:
    return {**decoding_inputs(draw, B, length, d_model, num_heads, num_kv_heads, bias, dtype, chunkings, cached),
            "rope_base": base}


def token_by_token_inputs(draw: Draw) -> Inputs:
    return Inputs(rotary_decoding_inputs(draw, 2, 6, 32, 4, 2, True, torch.float64, [[1] * 6], DEFAULT_BASE),
                  "one token per step from no cache: token i at position i")


def chunked_inputs(draw: Draw) -> Inputs:
    return Inputs(rotary_decoding_inputs(draw, 2, 7, 32, 4, 2, True, torch.float64, [[3, 4], [2, 3, 2], [4, 1, 2]],
                                         500.0),
                  "the same sequence in three chunkings, rope_base=500.0")


GIVEN_CACHES = {"empty cache (t = 0)": 0, "cache of 4 tokens": 4}


def given_cache_inputs(draw: Draw, case: str) -> Inputs:
    cached = GIVEN_CACHES[case]
    return Inputs(rotary_decoding_inputs(draw, 2, 3, 24, 6, 3, False, torch.float32, [[3]], 100.0, cached=cached),
                  f"3 new tokens after a given cache of {cached} rotated keys (positions {cached} .. {cached + 2}), "
                  "rope_base=100.0, no biases")


# Hidden cases.

def rotation_random_inputs(draw: Draw, interleaved: bool) -> Inputs:
    lead = tuple(draw.integer(1, 3) for _ in range(draw.integer(0, 2)))
    T, d = draw.integer(2, 9), draw.choice(WIDTHS)
    dtype = draw.choice([torch.float32, torch.float64])
    # float32 holds an angle p * theta to about 1e-7 of its size: positions stay small there.
    high = 32 if dtype == torch.float32 else 4096
    shape = draw.choice([(T,), (*lead, T), (*lead[:1], *[1] * len(lead[1:]), T)])
    positions = positions_tensor(draw, shape, high, draw.choice([torch.int64, torch.int32]), low=1)
    options = {"base": draw.choice(BASES), "interleaved": interleaved}
    return Inputs({"x": draw.normal(*lead, T, d, dtype=dtype), "positions": positions,
                   "calls": [("x", "positions", options)]}, "random sizes, positions, dtype and base")


def rotary_attention_random_inputs(draw: Draw) -> Inputs:
    num_heads, num_kv_heads = draw.choice(GROUPED + [(4, 1), (2, 2)])
    d_model, bias = num_heads * draw.choice([4, 6, 8]), draw.choice([True, False])
    dtype = draw.choice([torch.float32, torch.float64])
    B, T = draw.integer(1, 3), draw.integer(3, 9)
    values = module_inputs(draw.normal(B, T, d_model, dtype=dtype), d_model, num_heads, num_kv_heads, bias,
                           projection_weights(draw, d_model, num_heads, num_kv_heads, bias, dtype))
    values["mask"], note = random_mask(draw, draw.choice([(T, T), (B, num_heads, T, T)]), empty_rows=1)
    values["rope_base"] = draw.choice(BASES)
    return Inputs(values, f"random heads, dtype and base, mask with {note}")


def decode_random_inputs(draw: Draw) -> Inputs:
    num_heads, num_kv_heads = draw.choice(GROUPED + [(4, 1), (2, 1), (3, 3)])
    length = draw.integer(6, 12)
    cached = draw.choice([None, 0, draw.integer(1, 5)])
    values = rotary_decoding_inputs(draw, draw.integer(1, 3), length, num_heads * draw.choice([4, 6, 8]), num_heads,
                                    num_kv_heads, draw.choice([True, False]),
                                    draw.choice([torch.float32, torch.float64]),
                                    [ragged(draw, length), ragged(draw, length)], draw.choice(BASES), cached=cached)
    return Inputs(values, "random heads, base, dtype and cache, two random chunkings")


def long_decode_inputs(draw: Draw) -> Inputs:
    prefill, steps = draw.integer(4, 8), draw.integer(12, 16)
    return Inputs(rotary_decoding_inputs(draw, 2, prefill + steps, 32, 8, 2, True, torch.float32,
                                         [[prefill] + [1] * steps], draw.choice(BASES)),
                  f"a prefill of {prefill} tokens, then {steps} single-token steps")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(ROPE)
def test_rope_halves(submission, reference, draw):
    """pairs (x[i], x[i + d/2]) rotated by position times frequency"""
    inputs = rotation_inputs(draw, interleaved=False)
    assert_same(submission.rotations(inputs), reference.rotations(inputs), inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(ROPE)
def test_rope_interleaved(submission, reference, draw):
    """interleaved=True: pairs (x[2i], x[2i + 1])"""
    inputs = rotation_inputs(draw, interleaved=True)
    assert_same(submission.rotations(inputs), reference.rotations(inputs), inputs)


@pytest.mark.parametrize("shape", POSITION_SHAPES, ids=[f"positions {shape}" for shape in POSITION_SHAPES])
@pytest.mark.points(0.75)
@pytest.mark.uses(ROPE)
def test_rope_position_shapes(submission, reference, draw, shape):
    """positions of shape (T,) or broadcastable to x.shape[:-1]"""
    inputs = position_shape_inputs(draw, shape)
    assert_same(submission.rotations(inputs), reference.rotations(inputs), inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(ROPE)
def test_rope_odd_width(submission, reference, draw):
    """ValueError when the last dimension is odd"""
    inputs = odd_width_inputs(draw)
    assert_same(submission.odd_widths(inputs), reference.odd_widths(inputs), inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(MODULE)
def test_module_structure(submission, reference, draw):
    """the projections of GroupedQueryAttention, its ints and rope_base"""
    inputs = structure_inputs(draw)
    assert_same(submission.structure(inputs), reference.structure(inputs), inputs)


@pytest.mark.points(0.25)
@pytest.mark.uses(MODULE)
def test_value_errors(submission, reference, draw):
    """ValueError when d_model % num_heads or num_heads % num_kv_heads is not 0"""
    inputs = value_error_inputs(draw)
    assert_same(submission.value_errors(inputs), reference.value_errors(inputs), inputs)


@pytest.mark.parametrize("case", list(ATTENTION_CASES), ids=list(ATTENTION_CASES))
@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE)
def test_rotary_attention(submission, reference, draw, case):
    """queries and keys rotated per head before the scores, values not"""
    inputs = rotary_attention_inputs(draw, case)
    assert_same(submission.attention(inputs), reference.attention(inputs), inputs)


@pytest.mark.points(0.75)
@pytest.mark.uses(STEP)
def test_decode_token_by_token(submission, reference, draw):
    """single-token steps reproduce causal attention; the cache holds rotated keys"""
    inputs = token_by_token_inputs(draw)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.points(0.75)
@pytest.mark.uses(STEP)
def test_decode_chunked_prefill(submission, reference, draw):
    """every chunking gives the same outputs and cache"""
    inputs = chunked_inputs(draw)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.parametrize("case", list(GIVEN_CACHES), ids=list(GIVEN_CACHES))
@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_decode_given_cache(submission, reference, draw, case):
    """new tokens take positions t .. t + n - 1 after a cache of t rotated keys"""
    inputs = given_cache_inputs(draw, case)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.points(0.5)
@pytest.mark.uses(ROPE)
def test_rope_random(submission, reference, draw, interleaved):
    """random sizes, positions, bases and dtypes, in each layout"""
    inputs = rotation_random_inputs(draw, interleaved)
    assert_same(submission.rotations(inputs), reference.rotations(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(MODULE)
def test_rotary_attention_random(submission, reference, draw):
    """random groupings, bases, dtypes and masks"""
    inputs = rotary_attention_random_inputs(draw)
    assert_same(submission.attention(inputs), reference.attention(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_decode_random(submission, reference, draw):
    """random chunkings, groupings, bases and caches"""
    inputs = decode_random_inputs(draw)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(STEP)
def test_decode_long(submission, reference, draw):
    """many single-token steps after a prefill"""
    inputs = long_decode_inputs(draw)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)
