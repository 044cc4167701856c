"""`mla`: multi-head latent attention (DeepSeek-V2), decoding from a cache of latents with the
up-projections absorbed, and the size of that cache.

The decoding step is given a module built here from the case's weights (plain `nn.Linear`
layers, ints and the float `rope_base`, laid out as in the course's MultiHeadLatentAttention),
so that it does not depend on the learner's module. Its memory rule is a test of its own:
with one new token, no tensor created during the step may be as large as the cached latents
expanded into per-head keys or values.
"""

from __future__ import annotations

from numbers import Real

import pytest
import torch

from autograde.cases import Draw, Inputs
from autograde.exercises.mla import (
    BYTES,
    COMPUTED,
    EXPANDED,
    EXPANSION_FLOPS,
    FLOPS,
    LARGEST,
    LIMIT,
    MODULE,
    STEP,
    layer_shapes,
    memory_bounds,
)
from autograde.rules import judge
from autograde.testing import assert_rule, assert_same
from autograde.tests.test_kv_cache import ragged
from autograde.tests.test_rope import BASES
from autograde.tests.test_sdpa import bottom_right_causal, random_mask

ROPE_DIMS = {"rope_dim > 0": True, "rope_dim 0": False}
# (num_layers, kv_latent_dim, rope_dim) of DeepSeek-V2 (236B) and DeepSeek-V2-Lite (16B): both cache a latent
# of 512 and a rotary key of 64 per token and layer.
REAL_MODELS = [(60, 512, 64), (27, 512, 64)]


def _judge_memory(expected: dict, got: dict) -> list[str]:
    measured, allowed = got[LARGEST], expected[LIMIT]
    if not (isinstance(measured, Real) and not isinstance(measured, bool)):
        return [f"memory rule: `{LARGEST}` should be a number, got {measured!r}"]
    if measured <= allowed:
        return []
    return [f"memory rule broken: the largest tensor created by mla_decode_step holds {measured:,} elements, "
            f"{measured / allowed:.3g}x the {allowed:,} allowed ({LIMIT}); {EXPANDED} would hold "
            f"{expected[EXPANDED]:,}, the reference's largest holds {expected[LARGEST]:,}. Never expand the "
            "cached latent per head: absorb k_up into the queries and v_up into the outputs, and fold the heads "
            "into the query rows of one product with the latent (a batched matmul that broadcasts the latent "
            "over the heads copies it once per head)."]


def _judge_work(expected: dict, got: dict) -> list[str]:
    """An expansion, however split, computes the keys of every head: B*(t+1)*H*head_dim elements, at
    2*kv_latent_dim FLOPs each. The absorbed step computes fewer elements than that in all (0.3 to 0.9
    of it in these cases). Allowed: the reference's work plus half the expansion's FLOPs, and plus
    the expanded keys' elements (three more copies of the cache and then some, in these cases)."""
    problems = []
    for key, allowed, margin in ((COMPUTED, expected[COMPUTED] + expected[EXPANDED],
                                  "plus the expanded keys' elements"),
                                 (FLOPS, expected[FLOPS] + expected[EXPANSION_FLOPS] // 2,
                                  "plus half the FLOPs of expanding the keys")):
        measured = got[key]
        if not (isinstance(measured, Real) and not isinstance(measured, bool)):
            problems.append(f"weight absorption: `{key}` should be a number, got {measured!r}")
        elif measured > allowed:
            problems.append(
                f"weight absorption broken: {key}: {measured:,}, {measured / max(expected[key], 1):.3g}x the "
                f"reference's {expected[key]:,}; at most {allowed:,} are allowed (the reference's {margin}). The "
                "step never expands the cached latent per head, not even in pieces: absorb k_up into the queries "
                "and v_up into the outputs.")
    return problems


MEMORY_RULE = judge.Rule("memory", (LARGEST, COMPUTED, FLOPS),
                         lambda expected, got: _judge_memory(expected, got) + _judge_work(expected, got))


def latent_values(draw: Draw, x: torch.Tensor, num_heads: int, head_dim: int, kv_latent_dim: int, rope_dim: int,
                  base: float | None) -> dict:
    """x first (its dtype is the case's), the sizes, the base (None: the default) and seeded weights."""
    d_model = x.shape[-1]
    values = {"x": x, "d_model": d_model, "num_heads": num_heads, "head_dim": head_dim,
              "kv_latent_dim": kv_latent_dim, "rope_dim": rope_dim, "rope_base": base}
    for name, (in_features, out_features) in layer_shapes(d_model, num_heads, head_dim, kv_latent_dim,
                                                          rope_dim).items():
        values[f"{name}.weight"] = draw.normal(out_features, in_features, dtype=x.dtype, scale=in_features ** -0.5)
    return values


# Visible cases.

def structure_inputs(draw: Draw, rotary: bool) -> Inputs:
    if rotary:
        return Inputs({"d_model": 32, "num_heads": 4, "head_dim": 8, "kv_latent_dim": 12, "rope_dim": 4,
                       "rope_base": 500.0}, "a rotary part of width 4, rope_base=500.0")
    return Inputs({"d_model": 32, "num_heads": 4, "head_dim": 8, "kv_latent_dim": 12, "rope_dim": 0,
                   "rope_base": None}, "no rotary part (rope_dim=0), the default base")


def latent_attention_inputs(draw: Draw, rotary: bool) -> Inputs:
    T, dtype = 6, torch.float64
    values = latent_values(draw, draw.normal(2, T, 32, dtype=dtype), 4, 8, 12, 4 if rotary else 0,
                           500.0 if rotary else None)
    values["mask"] = bottom_right_causal(T, T)
    width = "rotary keys of width 4, rope_base=500.0" if rotary else "no rotary part (rope_dim=0)"
    return Inputs(values, f"4 heads of width 8, a latent of 12, {width}, causal mask")


def decoding_values(draw: Draw, B: int, length: int, d_model: int, num_heads: int, head_dim: int,
                    kv_latent_dim: int, rope_dim: int, base: float | None, dtype, chunkings: list[list[int]],
                    cached: int | None = None) -> dict:
    """The sequence `x` and its chunkings, optionally a cache of `cached` earlier tokens, sizes and weights."""
    assert all(sum(sizes) == length for sizes in chunkings)
    values = latent_values(draw, draw.normal(B, length, d_model, dtype=dtype), num_heads, head_dim, kv_latent_dim,
                           rope_dim, base)
    values["chunkings"] = chunkings
    if cached is not None:
        values["cache_latent"] = draw.normal(B, cached, kv_latent_dim, dtype=dtype)
        values["cache_rope_keys"] = draw.normal(B, cached, rope_dim, dtype=dtype)
    return values


def token_by_token_inputs(draw: Draw) -> Inputs:
    return Inputs(decoding_values(draw, 2, 6, 32, 4, 8, 12, 4, None, torch.float64, [[1] * 6]),
                  "one token per step from no cache: token i at position i")


def chunked_inputs(draw: Draw, rotary: bool) -> Inputs:
    values = decoding_values(draw, 2, 7, 32, 4, 8, 12, 4 if rotary else 0, 500.0 if rotary else None,
                             torch.float64, [[3, 4], [2, 3, 2], [4, 1, 2]])
    return Inputs(values, "the same sequence in three chunkings, " +
                  ("rotary keys of width 4, rope_base=500.0" if rotary else "no rotary part (rope_dim=0)"))


GIVEN_CACHES = {"empty cache (t = 0)": 0, "cache of 5 tokens": 5}


def given_cache_inputs(draw: Draw, case: str) -> Inputs:
    cached = GIVEN_CACHES[case]
    return Inputs(decoding_values(draw, 2, 3, 24, 6, 4, 10, 8, 100.0, torch.float32, [[3]], cached=cached),
                  f"3 new tokens after a given cache of {cached} latents and rotated keys "
                  f"(positions {cached} .. {cached + 2}), rope_base=100.0")


def memory_inputs(draw: Draw) -> Inputs:
    values = decoding_values(draw, 2, 1, 64, 8, 16, 32, 8, None, torch.float32, [[1]], cached=255)
    bounds = memory_bounds(Inputs(values))
    return Inputs(values, f"one new token after 255 cached: {EXPANDED} would hold {bounds[EXPANDED]:,} elements, "
                          f"{bounds[EXPANDED] / bounds[LIMIT]:.3g}x the {bounds[LIMIT]:,} allowed")


def cache_bytes_inputs(draw: Draw) -> Inputs:
    calls = [((*model, 4096, 1), None) for model in REAL_MODELS]
    calls += [((60, 512, 64, 128 * 1024, 8), 1), ((60, 512, 0, 1, 1), 4), ((1, 512, 64, 1, 1), None)]
    return Inputs({"calls": calls}, "DeepSeek-V2 and DeepSeek-V2-Lite; an 8-bit and a float32 cache")


# Hidden cases.

def latent_attention_random_inputs(draw: Draw, rotary: bool) -> Inputs:
    # One head would make a rotary key per head the same as a shared one.
    num_heads, head_dim = draw.choice([2, 4, 6] if rotary else [1, 2, 4, 6]), draw.choice([4, 6, 8])
    rope_dim = draw.choice([2, 4, 8]) if rotary else 0
    B, T, dtype = draw.integer(1, 3), draw.integer(4, 9), draw.choice([torch.float32, torch.float64])
    values = latent_values(draw, draw.normal(B, T, draw.choice([16, 24, 32]), dtype=dtype), num_heads, head_dim,
                           draw.integer(2, 16), rope_dim, draw.choice([None, *BASES]))
    values["mask"], note = random_mask(draw, draw.choice([(T, T), (B, num_heads, T, T), (B, 1, T, T)]),
                                       empty_rows=1)
    return Inputs(values, f"random sizes, dtype and base, mask with {note}")


def decode_random_inputs(draw: Draw, rotary: bool) -> Inputs:
    length = draw.integer(6, 12)
    values = decoding_values(draw, draw.integer(1, 3), length, draw.choice([16, 24, 32]), draw.choice([1, 2, 4, 6]),
                             draw.choice([4, 6, 8]), draw.integer(2, 16), draw.choice([2, 4, 8]) if rotary else 0,
                             draw.choice([None, *BASES]), draw.choice([torch.float32, torch.float64]),
                             [ragged(draw, length), ragged(draw, length)],
                             cached=draw.choice([None, 0, draw.integer(1, 6)]))
    return Inputs(values, "random sizes, base, dtype and cache, two random chunkings")


def memory_random_inputs(draw: Draw) -> Inputs:
    num_heads, head_dim = draw.choice([8, 16]), draw.choice([16, 32])
    rope_dim = draw.choice([0, 8, 16])
    kv_latent_dim = draw.choice([c for c in (16, 32, 64) if c + rope_dim <= num_heads * head_dim // 4])
    values = decoding_values(draw, draw.integer(1, 2), 1, draw.choice([32, 64]), num_heads, head_dim,
                             kv_latent_dim, rope_dim, None, torch.float32, [[1]], cached=draw.integer(300, 400))
    return Inputs(values, "one new token after a long cache, random sizes")


def cache_bytes_random_inputs(draw: Draw) -> Inputs:
    calls = [((draw.integer(1, 96), draw.choice([128, 256, 512, 1024]), draw.choice([32, 64, 128]),
               draw.integer(1, 2**17), draw.integer(1, 64)), bytes_per_element)
             for bytes_per_element in (None, 1, 2, 4)]
    return Inputs({"calls": calls}, "random configurations and element sizes")


# The tests.

@pytest.mark.parametrize("rotary", list(ROPE_DIMS.values()), ids=list(ROPE_DIMS))
@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_module_structure(submission, reference, draw, rotary):
    """the projections of the contract (k_rope shared, None without a rotary part), the ints and rope_base"""
    inputs = structure_inputs(draw, rotary)
    assert_same(submission.structure(inputs), reference.structure(inputs), inputs)


@pytest.mark.parametrize("rotary", list(ROPE_DIMS.values()), ids=list(ROPE_DIMS))
@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE)
def test_latent_attention(submission, reference, draw, rotary):
    """content scores from the latent plus rotary scores, scaled by 1/sqrt(head_dim + rope_dim)"""
    inputs = latent_attention_inputs(draw, rotary)
    assert_same(submission.attention(inputs), reference.attention(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_decode_token_by_token(submission, reference, draw):
    """single-token steps reproduce causal attention; the cache holds latents and rotated keys"""
    inputs = token_by_token_inputs(draw)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.parametrize("rotary", list(ROPE_DIMS.values()), ids=list(ROPE_DIMS))
@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_decode_chunked_prefill(submission, reference, draw, rotary):
    """every chunking gives the same outputs and cache"""
    inputs = chunked_inputs(draw, rotary)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.parametrize("case", list(GIVEN_CACHES), ids=list(GIVEN_CACHES))
@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_decode_given_cache(submission, reference, draw, case):
    """new tokens take positions t .. t + n - 1 after a cache of t latents and rotated keys"""
    inputs = given_cache_inputs(draw, case)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_memory_rule(submission, reference, draw):
    """one new token: no tensor as large as the latents expanded per head, nor the work of expanding them"""
    inputs = memory_inputs(draw)
    assert_rule(submission.decode_memory(inputs), reference.decode_memory(inputs), MEMORY_RULE, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(BYTES)
def test_cache_bytes(submission, reference, draw):
    """the cache of real models, in bytes"""
    inputs = cache_bytes_inputs(draw)
    assert_same(submission.cache_sizes(inputs), reference.cache_sizes(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("rotary", list(ROPE_DIMS.values()), ids=list(ROPE_DIMS))
@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_latent_attention_random(submission, reference, draw, rotary):
    """random sizes, bases, dtypes and masks"""
    inputs = latent_attention_random_inputs(draw, rotary)
    assert_same(submission.attention(inputs), reference.attention(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("rotary", list(ROPE_DIMS.values()), ids=list(ROPE_DIMS))
@pytest.mark.points(1.0)
@pytest.mark.uses(STEP)
def test_decode_random(submission, reference, draw, rotary):
    """random sizes, chunkings, bases and caches"""
    inputs = decode_random_inputs(draw, rotary)
    assert_same(submission.decode(inputs), reference.decode(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(STEP)
def test_memory_rule_random(submission, reference, draw):
    """the memory and work bounds with random sizes"""
    inputs = memory_random_inputs(draw)
    assert_rule(submission.decode_memory(inputs), reference.decode_memory(inputs), MEMORY_RULE, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(BYTES)
def test_cache_bytes_random(submission, reference, draw):
    """random configurations and bytes per element"""
    inputs = cache_bytes_random_inputs(draw)
    assert_same(submission.cache_sizes(inputs), reference.cache_sizes(inputs), inputs)
