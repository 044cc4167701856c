"""`window`: sliding-window attention, a rolling KV cache and attention sinks.

The mask is compared whole, for windows inside the sequence, of 1 key and at least as long as it,
with as many queries as keys, fewer (after a cache: bottom-right aligned) and more (rows that see
nothing). The attention is compared over the same axes, without sink logits and with ordinary,
very negative (the sink takes nothing) and very positive ones (the keys keep almost nothing). The
rolling cache is fed token by token and in chunks longer than its window, with and without sinks;
what `keys_values()` returns after every append is compared, positions included. Its storage is
measured in the learner's process from the tensors the cache object holds (its attributes, and the
lists, tuples, dicts and objects they hold): their bytes after 10 windows of appends must be those
of `sinks + window` slots of keys and values, in the same storages as after the first append. A
hidden test also measures it from outside the learner's processes, as the memory they gained while
a cache of about 1k wide slots took 10 windows of tokens: at most 6x the slots' bytes. The other
hidden tests are parametrised by those axes, so that every graded run covers every value of each,
each case in float32 or float64 so that every value meets both.
"""

from __future__ import annotations

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.window import ATTENTION, CACHE, HELD_BYTES, MASK, SAME_STORAGE
from autograde.rules import judge
from autograde.testing import assert_same

# The axes of the hidden tests (their values are the test ids).
DTYPES = {"float32": torch.float32, "float64": torch.float64}
WINDOWS = ("window inside the sequence", "window 1", "window >= S")
QUERIES = ("L = S", "L < S (after a cache)", "L > S (rows that see nothing)")
SINKS = ("no sink logits", "ordinary sink logits", "very negative sink logits", "very positive sink logits")
MASK_CASES = {f"{window}, {queries}": (window, queries) for window in WINDOWS for queries in QUERIES}
ATTENTION_CASES = alternate_dtypes({f"{window}, {queries}, {sinks}": (window, queries, sinks)
                                    for window in WINDOWS for queries in QUERIES for sinks in SINKS})
CACHE_SINKS = ("no sinks", "sinks")
CHUNKS = ("token by token", "chunks longer than the window")
CACHE_WINDOWS = ("window 1", "window of several tokens")
CACHE_CASES = {f"{sinks}, {chunks}, {window}, {dtype}": (sinks, chunks, window, dtype)
               for sinks in CACHE_SINKS for chunks in CHUNKS for window in CACHE_WINDOWS for dtype in DTYPES}
# The rolling cache measured from outside: slots of 4 heads of width 256 in float32, 8 KiB a token, for windows
# of about 1k tokens (7 to 8 MiB: wide tokens, so that a cache appending token by token makes few calls), fed 10
# windows in chunks of half a window. Its processes may gain up to 6x the slots' bytes (the solution: about 1.5x;
# keeping every token: 11x; tests/test_exercise_window.py).
OUTSIDE_HEADS, OUTSIDE_WIDTH, OUTSIDE_WINDOWS, OUTSIDE_ALLOWED = 4, 256, 10, 6.0
# Beyond any score of normal inputs of width <= 16 (|q.k| / sqrt(d) stays below 20 on such draws).
EXTREME_SINK = 1000.0


# Inputs.

def window_for(draw: Draw, window: str, S: int) -> int:
    if window == "window 1":
        return 1
    if window == "window >= S":
        return draw.integer(S, S + 3)
    return draw.integer(2, S - 1)


def lengths_for(draw: Draw, queries: str) -> tuple[int, int]:
    S = draw.integer(4, 9)
    if queries == "L = S":
        return S, S
    if queries.startswith("L < S"):
        return draw.integer(1, S - 1), S
    return draw.integer(S + 1, S + 3), S


def attention_values(draw: Draw, B: int, H: int, L: int, S: int, d: int, window: int, dtype,
                     sinks: str = "no sink logits") -> dict:
    values = {"q": draw.normal(B, H, L, d, dtype=dtype), "k": draw.normal(B, H, S, d, dtype=dtype),
              "v": draw.normal(B, H, S, d, dtype=dtype), "window": window}
    if sinks == "ordinary sink logits":
        values["sink_logits"] = draw.normal(H, dtype=dtype, scale=2.0)
    elif sinks == "very negative sink logits":
        values["sink_logits"] = torch.full((H,), -EXTREME_SINK, dtype=dtype)
    elif sinks == "very positive sink logits":
        values["sink_logits"] = torch.full((H,), EXTREME_SINK, dtype=dtype)
    return values


def cache_values(draw: Draw, chunks: list[int], window: int, sinks: int, dtype, B: int = 2, H_kv: int = 2,
                 d: int = 4, more: list[int] | None = None) -> dict:
    """Tokens for `chunks`, recorded after each, then for `more`, recorded at the end only."""
    more = more or []
    T = sum(chunks) + sum(more)
    return {"k": draw.normal(B, H_kv, T, d, dtype=dtype), "v": draw.normal(B, H_kv, T, d, dtype=dtype),
            "window": window, "sinks": sinks, "chunks": chunks, "more": more}


def chunks_text(chunks: list[int]) -> str:
    return "token by token" if set(chunks) == {1} else f"chunks of {'+'.join(map(str, chunks))} tokens"


# Visible cases.

def mask_inputs(draw: Draw) -> Inputs:
    return Inputs({"shapes": [(6, 6, 3), (3, 8, 3), (8, 5, 2), (5, 5, 1), (4, 4, 10), (2, 7, 7)]},
                  "windows inside the sequence, of 1 and longer than it; L = S, L < S and L > S")


def attention_inputs(draw: Draw) -> Inputs:
    return Inputs(attention_values(draw, 2, 3, 7, 7, 8, 3, torch.float64), "L = S = 7, window 3, no sink logits")


def cache_attention_inputs(draw: Draw) -> Inputs:
    return Inputs(attention_values(draw, 2, 2, 3, 10, 8, 4, torch.float64),
                  "3 queries after a cache: S = 10 keys, window 4 (bottom-right aligned), no sink logits")


def sink_inputs(draw: Draw) -> Inputs:
    values = attention_values(draw, 2, 3, 8, 6, 8, 3, torch.float32, sinks="ordinary sink logits")
    return Inputs(values, "L = 8 > S = 6 (the first 2 rows see nothing), window 3, one sink logit per head")


def rolling_inputs(draw: Draw) -> Inputs:
    return Inputs(cache_values(draw, [1] * 9 + [3, 1], 4, 2, torch.float64),
                  "window 4, 2 sinks, 9 tokens one by one then 3 then 1: the ring wraps")


def storage_inputs(draw: Draw) -> Inputs:
    window, sinks = 5, 2
    chunks, more = [1] * 12 + [7, 1], [3] * 9 + [1] * 3
    return Inputs(cache_values(draw, chunks, window, sinks, torch.float32, B=1, H_kv=2, d=8, more=more),
                  f"window {window}, {sinks} sinks, float32: {sum(chunks) + sum(more)} tokens appended in ones and "
                  "chunks")


def outside_inputs(draw: Draw, window: int | None = None) -> Inputs:
    """A cache of about 1k slots fed 10 windows of tokens, in 20 chunks of half a window (`filled`)."""
    window = draw.integer(896, 1024) if window is None else window
    sinks, chunk = draw.integer(0, 4), max(1, window // 2)
    appends = OUTSIDE_WINDOWS * window // chunk
    return Inputs({"batch": 1, "kv_heads": OUTSIDE_HEADS, "head_dim": OUTSIDE_WIDTH, "window": window, "sinks": sinks,
                   "chunk": chunk, "appends": appends, "seed": draw.integer(0, 2**31 - 1)},
                  f"window {window}, {sinks} sinks, {OUTSIDE_HEADS} heads of width {OUTSIDE_WIDTH}, float32: "
                  f"{appends} chunks of {chunk} tokens appended")


def token_bytes(inputs: Inputs) -> int:
    """The bytes of one token's keys and values in `outside_inputs`' cache (float32)."""
    return 2 * inputs["batch"] * inputs["kv_heads"] * inputs["head_dim"] * 4


# Hidden cases.

def mask_random_inputs(draw: Draw, window: str, queries: str) -> Inputs:
    shapes = []
    for _ in range(3):
        L, S = lengths_for(draw, queries)
        shapes.append((L, S, window_for(draw, window, S)))
    return Inputs({"shapes": shapes}, f"{window}, {queries}")


def attention_random_inputs(draw: Draw, window: str, queries: str, sinks: str) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    L, S = lengths_for(draw, queries)
    B, H, d = draw.integer(1, 2), draw.integer(1, 4), draw.choice([4, 8, 16])
    return Inputs(attention_values(draw, B, H, L, S, d, window_for(draw, window, S), torch.float64, sinks),
                  f"{window}, {queries}, {sinks}")


def cache_random_inputs(draw: Draw, sinks: str, chunks: str, window: str, dtype) -> Inputs:
    size = 1 if window == "window 1" else draw.integer(2, 5)
    count = 0 if sinks == "no sinks" else draw.integer(1, 3)
    if chunks == "token by token":
        pieces = [1] * (3 * size + count + draw.integer(1, 4))
    else:
        pieces = [draw.integer(size + 1, size + 4) for _ in range(draw.integer(2, 4))]
    more = [1] * max(1, 10 * size - sum(pieces))  # then the storage is measured after 10 windows
    return Inputs(cache_values(draw, pieces, size, count, dtype, B=draw.integer(1, 2), H_kv=draw.integer(1, 3),
                               d=draw.choice([2, 4, 8]), more=more),
                  f"window {size}, {count} sinks, {chunks_text(pieces)}, then {len(more)} more one by one")


def storage_expected(inputs: Inputs) -> dict:
    """What a cache of sinks + window slots of keys and values holds, in the case's dtype."""
    batch, kv_heads, _, head_dim = inputs["k"].shape
    slots = inputs["sinks"] + inputs["window"]
    return {HELD_BYTES: 2 * batch * kv_heads * slots * head_dim * inputs["k"].element_size(), SAME_STORAGE: True}


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(MASK)
def test_sliding_window_mask(submission, reference, draw):
    """i + S - L - window < j <= i + S - L: windows of 1, inside and past the sequence, L = S, L < S, L > S"""
    inputs = mask_inputs(draw)
    assert_same(submission.masks(inputs), reference.masks(inputs), inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(ATTENTION)
def test_windowed_attention(submission, reference, draw):
    """each query attends the last `window` keys up to its own position"""
    inputs = attention_inputs(draw)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_windowed_attention_after_a_cache(submission, reference, draw):
    """fewer queries than keys: the window is aligned bottom-right, ending at each query's position"""
    inputs = cache_attention_inputs(draw)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(ATTENTION)
def test_sink_logits(submission, reference, draw):
    """a sink logit per head joins each row's softmax with value 0; rows that see nothing give 0"""
    inputs = sink_inputs(draw)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(CACHE)
def test_rolling_cache(submission, reference, draw):
    """the sinks, then the last `window` tokens, in order of position, with their positions, after each append"""
    inputs = rolling_inputs(draw)
    assert_same(submission.rolled(inputs), reference.rolled(inputs), inputs, ignore=(HELD_BYTES, SAME_STORAGE))


@pytest.mark.points(1.0)
@pytest.mark.uses(CACHE)
def test_cache_storage(submission, draw):
    """after 10 windows of appends it holds sinks + window slots of keys and values, allocated once"""
    inputs = storage_inputs(draw)
    assert_same(submission.rolled(inputs), storage_expected(inputs), inputs)  # only the storage's keys


@pytest.mark.hidden
@pytest.mark.parametrize("window, queries", list(MASK_CASES.values()), ids=list(MASK_CASES))
@pytest.mark.points(0.5625)  # 9 cases of 1/16: points that add up exactly
@pytest.mark.uses(MASK)
def test_mask_random(submission, reference, draw, window, queries):
    """every kind of window and every ratio of queries to keys"""
    inputs = mask_random_inputs(draw, window, queries)
    assert_same(submission.masks(inputs), reference.masks(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("window, queries, sinks, dtype", list(ATTENTION_CASES.values()), ids=list(ATTENTION_CASES))
@pytest.mark.points(1.125)  # 36 cases of 1/32
@pytest.mark.uses(ATTENTION)
def test_attention_random(submission, reference, draw, window, queries, sinks, dtype):
    """every kind of window, queries and sink logits, in float32 or float64"""
    drawn = attention_random_inputs(draw, window, queries, sinks)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("sinks, chunks, window, dtype", list(CACHE_CASES.values()), ids=list(CACHE_CASES))
@pytest.mark.points(0.3125)  # 16 cases of 5/256
@pytest.mark.uses(CACHE)
def test_cache_random(submission, reference, draw, sinks, chunks, window, dtype):
    """with and without sinks, token by token and in chunks longer than the window; its storage after 10 windows"""
    inputs = cache_random_inputs(draw, sinks, chunks, window, DTYPES[dtype])
    got = submission.rolled(inputs)
    assert_same(got, {**reference.rolled(inputs), **storage_expected(inputs)}, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(CACHE)
def test_cache_storage_measured_from_outside(submission, draw):
    """a cache of about 1k slots fed 10 windows: memory measured from outside your process, a few windows' worth"""
    submission.filled(outside_inputs(draw, window=64))  # code run for the first time, not measured
    inputs = outside_inputs(draw)
    with submission.cost_measured() as cost:
        submission.filled(inputs)
    slots = inputs["sinks"] + inputs["window"]
    call = f"{OUTSIDE_WINDOWS} windows of RollingKVCache.append"
    problems = judge.rolling_storage(call, cost, slots * token_bytes(inputs),
                                     inputs["appends"] * inputs["chunk"] * token_bytes(inputs), OUTSIDE_ALLOWED)
    if problems:
        raise AssertionError("\n".join([f"inputs: {inputs.describe()}", *problems]))
