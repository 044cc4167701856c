"""`kv_cache`: one decoding step of grouped-query attention with a key/value cache.

The step is given a module built here, in the probe, from the case's weights (plain
`nn.Linear` layers and ints, laid out as in the course's GroupedQueryAttention), so that this
exercise does not depend on the learner's answer to `gqa`, and no other code enters the worker.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.kv_cache import STEP
from autograde.testing import assert_same
from autograde.tests.test_gqa import BIASES, LAYOUTS, layout_heads, projection_weights

# The axes of the hidden tests (their values are the test ids); LAYOUTS and BIASES as in `gqa`.
CACHES = ("no cache", "a given cache")
CHUNKINGS = ("all in one step", "token by token", "ragged chunks", "several tokens after a first chunk")
DECODING_CASES = alternate_dtypes({f"{layout}, {bias}, {cache}, {chunking}": (layout, bias, cache, chunking)
                                   for layout in LAYOUTS for bias in BIASES
                                   for cache in CACHES for chunking in CHUNKINGS})
LONG_CACHES = ("no cache", "an empty cache (t = 0)")


def decoding_inputs(draw: Draw, B: int, length: int, d_model: int, num_heads: int, num_kv_heads: int, bias: bool,
                    dtype, chunkings: list[list[int]], cached: int | None = None) -> dict:
    """The sequence `x`, optionally a cache of `cached` earlier tokens, the chunkings and the weights."""
    assert all(sum(sizes) == length for sizes in chunkings)
    values = {"x": draw.normal(B, length, d_model, dtype=dtype)}
    if cached is not None:
        head_dim = d_model // num_heads
        values["cache_k"] = draw.normal(B, num_kv_heads, cached, head_dim, dtype=dtype)
        values["cache_v"] = draw.normal(B, num_kv_heads, cached, head_dim, dtype=dtype)
    return {**values, "d_model": d_model, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "bias": bias,
            "chunkings": chunkings, **projection_weights(draw, d_model, num_heads, num_kv_heads, bias, dtype)}


def ragged(draw: Draw, length: int) -> list[int]:
    """Random chunk sizes summing to `length`, with at least one chunk of 2 or more after the first."""
    first = draw.integer(1, length - 3)
    second = draw.integer(2, length - first - 1)
    sizes = [first, second]
    while sum(sizes) < length:
        sizes.append(draw.integer(1, min(4, length - sum(sizes))))
    return sizes


# Visible cases.

def whole_prompt_inputs(draw: Draw) -> Inputs:
    return Inputs(decoding_inputs(draw, 2, 5, 16, 4, 2, True, torch.float64, [[5]]),
                  "the whole prompt in one step, starting from no cache (t = 0)")


def token_by_token_inputs(draw: Draw) -> Inputs:
    return Inputs(decoding_inputs(draw, 2, 6, 16, 4, 2, True, torch.float64, [[1] * 6]),
                  "one token per step, starting from no cache")


def chunked_inputs(draw: Draw) -> Inputs:
    return Inputs(decoding_inputs(draw, 2, 7, 16, 4, 2, True, torch.float64, [[3, 4], [2, 3, 2], [4, 1, 2]]),
                  "the same sequence in three chunkings, chunks of several tokens after a cache")


def given_cache_inputs(draw: Draw) -> Inputs:
    return Inputs(decoding_inputs(draw, 2, 3, 12, 6, 3, False, torch.float32, [[3]], cached=4),
                  "3 new tokens after a given cache of 4 tokens, no biases")


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def chunk_sizes(draw: Draw, chunking: str, length: int) -> list[int]:
    if chunking == "all in one step":
        return [length]
    if chunking == "token by token":
        return [1] * length
    if chunking == "ragged chunks":
        return ragged(draw, length)
    first = draw.integer(1, length - 2)
    return [first, length - first]


def decoding_random_inputs(draw: Draw, layout: str, bias: bool, cache: str, chunking: str) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    num_heads, num_kv_heads = layout_heads(draw, layout)
    length = draw.integer(5, 9)
    cached = None if cache == "no cache" else draw.integer(1, 5)
    sizes = chunk_sizes(draw, chunking, length)
    values = decoding_inputs(draw, draw.integer(1, 3), length, num_heads * draw.integer(1, 3), num_heads,
                             num_kv_heads, bias, torch.float64, [sizes], cached=cached)
    note = (f"{num_heads} query heads, {num_kv_heads} key/value heads, {'with' if bias else 'without'} biases, "
            + ("no cache" if cached is None else f"a given cache of {cached} tokens"))
    return Inputs(values, note)


def long_decode_inputs(draw: Draw, cache: str) -> Inputs:
    prefill, steps = draw.integer(4, 8), draw.integer(12, 16)
    cached = None if cache == "no cache" else 0
    return Inputs(decoding_inputs(draw, 2, prefill + steps, 32, 8, 2, True, torch.float32,
                                  [[prefill] + [1] * steps], cached=cached),
                  f"a prefill of {prefill} tokens, then {steps} single-token steps, starting from {cache}")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_whole_prompt(submission, reference, draw):
    """the first step (no cache) is causal self-attention"""
    inputs = whole_prompt_inputs(draw)
    got, expected = submission.decode(inputs), reference.decode(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(STEP)
def test_token_by_token(submission, reference, draw):
    """single-token steps reproduce causal attention over the sequence"""
    inputs = token_by_token_inputs(draw)
    got, expected = submission.decode(inputs), reference.decode(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(STEP)
def test_chunked_prefill(submission, reference, draw):
    """every chunking gives the same outputs and cache"""
    inputs = chunked_inputs(draw)
    got, expected = submission.decode(inputs), reference.decode(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_given_cache(submission, reference, draw):
    """new tokens attend to the given cache, which grows at its end"""
    inputs = given_cache_inputs(draw)
    got, expected = submission.decode(inputs), reference.decode(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("layout, bias, cache, chunking, dtype", list(DECODING_CASES.values()),
                         ids=list(DECODING_CASES))
@pytest.mark.points(3.0)
@pytest.mark.uses(STEP)
def test_decoding_random(submission, reference, draw, layout, bias, cache, chunking, dtype):
    """every layout, biases on and off, no cache and a given one, every chunking, in float32 or float64"""
    drawn = decoding_random_inputs(draw, layout, BIASES[bias], cache, chunking)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.decode(inputs), reference.decode(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("cache", LONG_CACHES, ids=LONG_CACHES)
@pytest.mark.points(2.0)
@pytest.mark.uses(STEP)
def test_long_decode(submission, reference, draw, cache):
    """many single-token steps after a prefill"""
    inputs = long_decode_inputs(draw, cache)
    got, expected = submission.decode(inputs), reference.decode(inputs)
    assert_same(got, expected, inputs)
