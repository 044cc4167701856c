"""`paged_kv`: a paged KV cache: appending a token through the block table, in place, and attention of
one query per sequence over its cached tokens, read through the table.

The pools hold random values everywhere: in the slots of a sequence's last page past its length, in
the pages no table lists, and the table's entries past a sequence's last page name pages that are
never written (or, in one test, no page at all). `append_to_paged_cache` runs where the learner's code
runs, on copies; what its arguments hold after the call comes back and is compared, the new slots
and, separately, everything else. The hidden tests are parametrised by the contract's axes, so that
every graded run covers every value of each: tables in order, shuffled and sharing a prefix; lengths
ending mid-page and at a page boundary; page sizes 1, 3 and 16; the MHA, GQA and MQA layouts; each case in
float32 or float64, so that every value of every axis meets both.
"""

from __future__ import annotations

import math

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.paged_kv import APPEND, ATTENTION, ELSEWHERE, WRITTEN
from autograde.testing import assert_same
from autograde.tests.test_gqa import LAYOUTS, layout_heads

# The axes of the hidden tests (their values are the test ids).
TABLES = ("pages in order", "pages shuffled", "a shared prefix")
ENDS = ("lengths ending mid-page", "lengths ending at a page boundary")
APPEND_ENDS = ("new tokens mid-page", "new tokens starting a page")
PAGE_SIZES = {"page size 1": 1, "page size 3": 3, "page size 16": 16}
APPEND_CASES = alternate_dtypes({f"{ends}, {table}": (ends, table) for ends in APPEND_ENDS for table in TABLES})
ATTENTION_CASES = alternate_dtypes({f"{table}, {ends}, {layout}": (table, ends, layout)
                                    for table in TABLES for ends in ENDS for layout in LAYOUTS})
RANDOM_PAGE_SIZES = (2, 4, 5, 8)


# Inputs.

def paged_cache(draw: Draw, lengths: list[int], page_size: int, kv_heads: int, width: int, dtype,
                table: str = "pages in order", shared: int = 0, reserve: int = 0,
                padding: tuple[int, ...] | None = None) -> dict:
    """A pool of pages holding sequences of `lengths` tokens through a block table, random values everywhere.

    `table`: "pages in order" (each row's pages increasing), "pages shuffled" (in every row with two
    pages or more holding tokens, the last of them is not the largest, so the row is not in order) or
    "a shared prefix" (the first `shared` pages, full, are the same in every row; rows increasing).
    `reserve`: tokens past each length whose pages are in the table already (for appends). The entries
    past a row's pages name spare pages that no row holds, or are drawn from `padding` when given.
    """
    assert all(n >= shared * page_size for n in lengths)
    spans = [math.ceil((n + reserve) / page_size) for n in lengths]
    spare = draw.integer(1, 3)
    num_pages = spare + shared + sum(span - shared for span in spans)
    order = torch.randperm(num_pages, generator=draw.generator).tolist()
    spare_pages, taken = order[:spare], order[spare:]
    if table != "pages shuffled":  # the shared pages are the smallest, each row's own pages increasing
        taken = sorted(taken)
        taken = taken[:shared] + draw.py.sample(taken[shared:], len(taken) - shared)
    width_of_table = max(spans) + draw.integer(1, 2)
    rows, start = [], shared
    for n, span in zip(lengths, spans):
        own = taken[start:start + span - shared]
        start += span - shared
        if table == "pages shuffled":
            used = math.ceil(n / page_size)
            if used >= 2 and max(own[:used]) == own[used - 1]:
                swap = draw.integer(0, used - 2)
                own[swap], own[used - 1] = own[used - 1], own[swap]
        else:
            own = sorted(own)
        tail = [draw.choice(padding if padding is not None else spare_pages) for _ in range(width_of_table - span)]
        rows.append(taken[:shared] + own + tail)
    return {"k_pages": draw.normal(num_pages, kv_heads, page_size, width, dtype=dtype),
            "v_pages": draw.normal(num_pages, kv_heads, page_size, width, dtype=dtype),
            "block_table": torch.tensor(rows, dtype=torch.int64), "seq_lens": torch.tensor(lengths, dtype=torch.int64)}


def length_ending(draw: Draw, ends: str, page_size: int, full_pages: int) -> int:
    """A length of `full_pages` full pages or a few more, ending mid-page or at a page boundary."""
    pages = draw.integer(full_pages, full_pages + 3)
    if ends.endswith("mid-page"):
        return pages * page_size + draw.integer(1, page_size - 1)
    return pages * page_size


def heads_text(H: int, H_kv: int) -> str:
    return f"{H} query heads, {H_kv} key/value head{'s' if H_kv > 1 else ''}"


def lengths_text(inputs: dict) -> str:
    page_size = inputs["k_pages"].shape[2]
    return f"page size {page_size}, seq_lens {', '.join(map(str, inputs['seq_lens'].tolist()))}"


# Visible cases.

def append_inputs(draw: Draw) -> Inputs:
    cache = paged_cache(draw, [5, 8, 2], 4, 2, 8, torch.float64, table="pages shuffled", reserve=1)
    new = {"k_new": draw.normal(3, 2, 8), "v_new": draw.normal(3, 2, 8)}
    return Inputs({**cache, **new}, f"{lengths_text(cache)} (the second sequence's new token starts a page), "
                                    "pages shuffled")


def attention_inputs(draw: Draw) -> Inputs:
    cache = paged_cache(draw, [7, 13, 4], 4, 2, 8, torch.float64, table="pages shuffled")
    return Inputs({"q": draw.normal(3, 4, 8), **cache}, f"{lengths_text(cache)}, pages shuffled, {heads_text(4, 2)}")


def shared_prefix_inputs(draw: Draw) -> Inputs:
    cache = paged_cache(draw, [11, 9], 4, 1, 8, torch.float32, table="a shared prefix", shared=2)
    return Inputs({"q": draw.normal(2, 4, 8, dtype=torch.float32), **cache},
                  f"{lengths_text(cache)}, both sequences' first 2 pages are the same pages, {heads_text(4, 1)}")


def table_padding_inputs(draw: Draw) -> Inputs:
    cache = paged_cache(draw, [4, 8, 12], 4, 2, 8, torch.float64, padding=(-1, 10**9))
    return Inputs({"q": draw.normal(3, 2, 8), **cache},
                  f"{lengths_text(cache)}; the table's entries past each sequence's last page are -1 or 10**9")


def decode_inputs(draw: Draw) -> Inputs:
    steps, B, H, H_kv, d = 4, 2, 4, 2, 8
    cache = paged_cache(draw, [4, 6], 3, H_kv, d, torch.float64, table="pages shuffled", reserve=steps)
    values = {"q": draw.normal(steps, B, H, d), **cache, "k_new": draw.normal(steps, B, H_kv, d),
              "v_new": draw.normal(steps, B, H_kv, d)}
    return Inputs(values, f"{lengths_text(cache)}, then {steps} steps, each appending a token to every sequence "
                          f"(seq_lens + 1 after it) and attending; pages shuffled, {heads_text(H, H_kv)}")


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def append_random_inputs(draw: Draw, ends: str, table: str) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    B, H_kv, d, page_size = draw.integer(2, 3), draw.integer(1, 3), draw.choice([4, 8, 16]), \
        draw.choice(RANDOM_PAGE_SIZES)
    shared = draw.integer(1, 2) if table == "a shared prefix" else 0
    lengths = [length_ending(draw, ends, page_size, max(shared, 1)) for _ in range(B)]
    cache = paged_cache(draw, lengths, page_size, H_kv, d, torch.float64, table=table, shared=shared, reserve=1)
    return Inputs({**cache, "k_new": draw.normal(B, H_kv, d), "v_new": draw.normal(B, H_kv, d)}, table)


def attention_random_inputs(draw: Draw, table: str, ends: str, layout: str) -> Inputs:
    """In float64; the test casts them to its case's dtype."""
    H, H_kv = layout_heads(draw, layout)
    B, d, page_size = draw.integer(2, 3), draw.choice([4, 8, 16]), draw.choice(RANDOM_PAGE_SIZES)
    shared = draw.integer(1, 2) if table == "a shared prefix" else 0
    # Shuffled rows hold two pages or more, so that their order shows.
    full_pages = max(shared, 2 if table == "pages shuffled" and ends.endswith("boundary") else 1)
    lengths = [length_ending(draw, ends, page_size, full_pages) for _ in range(B)]
    cache = paged_cache(draw, lengths, page_size, H_kv, d, torch.float64, table=table, shared=shared)
    return Inputs({"q": draw.normal(B, H, d), **cache}, heads_text(H, H_kv))


def page_size_inputs(draw: Draw, page_size: int) -> Inputs:
    """Shuffled tables; the first sequence ends mid-page (but with pages of 1 token), the others anywhere."""
    B, H, H_kv, d = 3, 4, 2, 8
    lengths = [draw.integer(page_size + 1, 3 * page_size + 1) for _ in range(B)]
    if page_size > 1:
        lengths[0] = length_ending(draw, "mid-page", page_size, 1)
    cache = paged_cache(draw, lengths, page_size, H_kv, d, torch.float64, table="pages shuffled")
    return Inputs({"q": draw.normal(B, H, d), **cache}, f"page size {page_size}")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(APPEND)
def test_append_writes_its_slots(submission, reference, draw):
    """each new token lands in slot seq_lens % page_size of its page, found through the table"""
    inputs = append_inputs(draw)
    assert_same(submission.appended(inputs), reference.appended(inputs), inputs, ignore=ELSEWHERE)


@pytest.mark.points(1.0)
@pytest.mark.uses(APPEND)
def test_append_changes_nothing_else(submission, reference, draw):
    """other slots and pages, the table and seq_lens are left as they were"""
    inputs = append_inputs(draw)
    assert_same(submission.appended(inputs), reference.appended(inputs), inputs, ignore=WRITTEN)


@pytest.mark.points(1.5)
@pytest.mark.uses(ATTENTION)
def test_paged_attention(submission, reference, draw):
    """one query per sequence over its tokens, read through a shuffled table, grouped heads"""
    inputs = attention_inputs(draw)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(ATTENTION)
def test_paged_attention_shared_prefix(submission, reference, draw):
    """sequences that share their first pages, one key/value head"""
    inputs = shared_prefix_inputs(draw)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.points(0.75)
@pytest.mark.uses(ATTENTION)
def test_paged_attention_table_padding(submission, reference, draw):
    """the table's entries past a sequence's last page are not read"""
    inputs = table_padding_inputs(draw)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(APPEND, ATTENTION)
def test_decode_steps(submission, reference, draw):
    """appending and attending, step after step, across page boundaries"""
    inputs = decode_inputs(draw)
    assert_same(submission.decoded(inputs), reference.decoded(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("ends, table, dtype", list(APPEND_CASES.values()), ids=list(APPEND_CASES))
@pytest.mark.points(0.75)
@pytest.mark.uses(APPEND)
def test_append_random(submission, reference, draw, ends, table, dtype):
    """new tokens mid-page and starting a page, every kind of table, in float32 or float64"""
    drawn = append_random_inputs(draw, ends, table)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    assert_same(submission.appended(inputs), reference.appended(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("table, ends, layout, dtype", list(ATTENTION_CASES.values()), ids=list(ATTENTION_CASES))
@pytest.mark.points(2.25)
@pytest.mark.uses(ATTENTION)
def test_paged_attention_random(submission, reference, draw, table, ends, layout, dtype):
    """every kind of table, lengths ending mid-page and at a boundary, every layout, in float32 or float64"""
    drawn = attention_random_inputs(draw, table, ends, layout)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("page_size", list(PAGE_SIZES.values()), ids=list(PAGE_SIZES))
@pytest.mark.points(0.75)
@pytest.mark.uses(ATTENTION)
def test_paged_attention_page_sizes(submission, reference, draw, page_size):
    """pages of 1, 3 and 16 tokens"""
    inputs = page_size_inputs(draw, page_size)
    assert_same(submission.attended(inputs), reference.attended(inputs), inputs)
