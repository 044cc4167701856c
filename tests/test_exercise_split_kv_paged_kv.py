"""The exercises `split_kv` and `paged_kv`: graded end to end, wrong answers caught (each losing exactly its
tests on several seeds), right ones in other styles accepted, and the references checked against oracles
that are not the course's code: attention over all the keys at once in float64 (PyTorch's own, with
`enable_gqa=True` and a bottom-right mask, and `torch.logsumexp`), each chunk's attention alone, and
the keys of a paged cache gathered token by token.
"""

from __future__ import annotations

import math
import re

import nbformat
import pytest
import torch
import torch.nn.functional as F

from autograde import registry as exercises
from autograde import solutions
from autograde.cases import FLOAT_DTYPES
from autograde.exercises import paged_kv as paged_kv_definition
from autograde.exercises import split_kv as split_kv_definition
from autograde.grading.session import catalogue, max_score
from autograde.tests import test_paged_kv as PAGED_TESTS
from autograde.tests import test_split_kv as SPLIT_TESTS
from tests.fixtures.implementations import Variant, fs, variant_id
from tests.fixtures.notebooks import (
    ROOT,
    failed,
    grade_in_process,
    graded_on_seed,
    learner_notebook,
    lost,
    on_every_seed,
    replaced,
    sent_inputs,
)

pytestmark = pytest.mark.timeout(300)

SPLIT_KV = solutions.namespace(exercises.get("split_kv"))
PAGED_KV = solutions.namespace(exercises.get("paged_kv"))
MERGE, SPLIT, APPEND, ATTENTION = "merge_attention_states", "split_kv_attention", "append_to_paged_cache", \
    "paged_attention"


# Wrong answers lose exactly the tests they break; right answers in other styles pass.

def cases(test: str, table: dict[str, tuple], keep) -> frozenset[str]:
    """The report names of the cases of a parametrised test (`table`: id -> axes) whose axes `keep` accepts."""
    return frozenset(f"{test}[{case}]" for case, axes in table.items() if keep(*axes))


def kind(layout: str) -> str:
    """"MHA", "GQA" or "MQA"."""
    return layout.split()[0]


MERGES, SPLITS = SPLIT_TESTS.MERGE_CASES, SPLIT_TESTS.SPLIT_CASES
APPENDS, PAGED = PAGED_TESTS.APPEND_CASES, PAGED_TESTS.ATTENTION_CASES
LARGE_SCORES = fs("split-kv-large-scores[float32]", "split-kv-large-scores[float64]")
LARGE_LSE = cases("merge-random", MERGES, lambda magnitude, dtype: magnitude != "ordinary lse")
EMPTY_CHUNK = "            continue  # an empty chunk: attention over no keys, out 0 and lse -inf as initialised\n"
ALL_APPENDS = cases("append-random", APPENDS, lambda ends, table, dtype: True)

NAIVE_MERGE = '''
import math

import torch


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """The formula as written: exp(lse) overflows past 88.7 in float32, and -inf - (-inf) is NaN."""
    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse
'''

SPLIT_WRONG = [
    Variant("merge-without-the-maximum", "split_kv", {MERGE: NAIVE_MERGE},
            fs("merge-empty-sides", "merge-large-lse", "split-kv-rows-attending-nothing"),
            LARGE_LSE | LARGE_SCORES),
    # A kernel's running state after visiting no key (accumulator 0, sum 0), normalised like any other: 0 / 0.
    Variant("empty-chunk-gives-nan", "split_kv", {SPLIT: replaced(
        "split_kv", SPLIT, (EMPTY_CHUNK, "            total = q.new_zeros(batch, heads, queries, 1)\n"
                                         "            partial_out[:, :, split] = partial_out[:, :, split] / total\n"
                                         "            out, lse = merge_attention_states(out, lse, "
                                         "partial_out[:, :, split], partial_lse[:, :, split])\n"
                                         "            continue\n"))},
        fs("split-kv-empty-chunks"),
        cases("split-kv-random", SPLITS, lambda splits, *_: splits == "more splits than keys")),
    # ceil(S / n) written as S // n + 1: one key too many when n divides S.
    Variant("chunks-one-key-too-long", "split_kv", {SPLIT: replaced(
        "split_kv", SPLIT, ("size = math.ceil(length / num_splits)", "size = length // num_splits + 1"))},
        fs("split-kv-causal"), cases("split-kv-random", SPLITS, lambda splits, *_: splits == "splits dividing S")),
    Variant("query-head-i-reads-kv-head-i-mod-h-kv", "split_kv", {SPLIT: replaced(
        "split_kv", SPLIT, ("k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)",
                            "k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)"))},
        fs("split-kv-decode"),  # MHA and MQA cannot tell
        cases("split-kv-random", SPLITS, lambda *axes: kind(axes[3]) == "GQA") | LARGE_SCORES),
    Variant("top-left-causal-mask", "split_kv", {SPLIT: replaced(
        "split_kv", SPLIT, ("[:, None] + (length - queries)", "[:, None]"))},
        fs("split-kv-decode", "split-kv-causal", "split-kv-rows-attending-nothing"),
        cases("split-kv-random", SPLITS, lambda splits, queries, causal, layout, dtype: SPLIT_TESTS.CAUSAL[causal])
        | LARGE_SCORES),
]

SORTED, PAST_THE_END = "pages shuffled", "lengths ending mid-page"
PAGED_WRONG = [
    Variant("pages-in-the-order-of-their-numbers", "paged_kv", {ATTENTION: replaced(
        "paged_kv", ATTENTION, ("pages = block_table[b, :count]", "pages = block_table[b, :count].sort().values"))},
        fs("paged-attention", "decode-steps"),  # pages in order, or only full pages, cannot tell
        cases("paged-attention-random", PAGED,
              lambda table, ends, layout, dtype: (table, ends) == (SORTED, PAST_THE_END))
        | fs("paged-attention-page-sizes[page size 3]", "paged-attention-page-sizes[page size 16]")),
    Variant("attends-the-whole-last-page", "paged_kv", {ATTENTION: replaced(
        "paged_kv", ATTENTION, ("[:, :length]\n", "\n"))},
        fs("paged-attention", "paged-attention-shared-prefix", "decode-steps"),
        cases("paged-attention-random", PAGED, lambda table, ends, layout, dtype: ends == PAST_THE_END)
        | fs("paged-attention-page-sizes[page size 3]", "paged-attention-page-sizes[page size 16]")),
    Variant("query-head-i-reads-kv-head-i-mod-h-kv", "paged_kv", {ATTENTION: replaced(
        "paged_kv", ATTENTION, ("keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)",
                                "keys.repeat(group, 1, 1), values.repeat(group, 1, 1)"))},
        fs("paged-attention", "decode-steps"),
        cases("paged-attention-random", PAGED, lambda table, ends, layout, dtype: kind(layout) == "GQA")
        | fs(*(f"paged-attention-page-sizes[{case}]" for case in PAGED_TESTS.PAGE_SIZES))),
    Variant("reads-every-entry-of-the-table", "paged_kv", {ATTENTION: replaced(
        "paged_kv", ATTENTION, ("pages = block_table[b, :count]", "pages = block_table[b]"),
        ("count * page_size", "len(pages) * page_size"))},
        fs("paged-attention-table-padding")),
    Variant("writes-at-the-last-cached-position", "paged_kv", {APPEND: replaced(
        "paged_kv", APPEND, ("seq_lens // page_size", "(seq_lens - 1) // page_size"),
        ("seq_lens % page_size", "(seq_lens - 1) % page_size"))},
        fs("append-writes-its-slots", "append-changes-nothing-else", "decode-steps"), ALL_APPENDS),
    Variant("page-of-the-last-cached-token", "paged_kv", {APPEND: replaced(
        "paged_kv", APPEND, ("seq_lens // page_size", "(seq_lens - 1) // page_size"))},
        fs("append-writes-its-slots", "append-changes-nothing-else", "decode-steps"),
        cases("append-random", APPENDS, lambda ends, table, dtype: ends == "new tokens starting a page")),
    Variant("writes-the-slot-in-every-page-of-the-row", "paged_kv", {APPEND: replaced(
        "paged_kv", APPEND, ("    k_pages[pages, :, slots] = k_new\n    v_pages[pages, :, slots] = v_new\n",
                             "    for b in range(len(seq_lens)):\n"
                             "        k_pages[block_table[b], :, slots[b]] = k_new[b]\n"
                             "        v_pages[block_table[b], :, slots[b]] = v_new[b]\n"))},
        fs("append-changes-nothing-else", "decode-steps"), ALL_APPENDS),
    Variant("counts-the-token-in-seq-lens", "paged_kv", {APPEND: replaced(
        "paged_kv", APPEND, ("    v_pages[pages, :, slots] = v_new\n",
                             "    v_pages[pages, :, slots] = v_new\n    seq_lens += 1\n"))},
        fs("append-changes-nothing-else", "decode-steps"), ALL_APPENDS),
]

WRONG = SPLIT_WRONG + PAGED_WRONG

RIGHT = [
    Variant("all-chunks-at-once-and-a-tree-of-merges", "split_kv", {MERGE: '''
import math

import torch


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    # The contract's formula: lse first, then each side's weight exp(lse_side - lse).
    top = torch.maximum(lse_a, lse_b).masked_fill(torch.maximum(lse_a, lse_b) == -math.inf, 0.0)
    lse = top + torch.log(torch.exp(lse_a - top) + torch.exp(lse_b - top))
    some = torch.isfinite(lse)
    at = torch.where(some, lse, torch.zeros_like(lse))
    weight_a = torch.where(some, torch.exp(lse_a - at), torch.zeros_like(lse))
    weight_b = torch.where(some, torch.exp(lse_b - at), torch.zeros_like(lse))
    return weight_a.unsqueeze(-1) * out_a + weight_b.unsqueeze(-1) * out_b, lse
''', SPLIT: '''
import torch.nn.functional as F


def split_kv_attention(q, k, v, num_splits, causal=False):
    # Keys padded to num_splits * c and viewed as (num_splits, c); the query heads grouped, no key copied.
    B, H, L, d = q.shape
    G, S = k.shape[1], k.shape[2]
    c = -(-S // num_splits)
    padded = num_splits * c
    keys = F.pad(k, (0, 0, 0, padded - S)).view(B, G, 1, num_splits, c, d)
    values = F.pad(v, (0, 0, 0, padded - S)).view(B, G, 1, num_splits, c, d)
    scores = q.view(B, G, H // G, 1, L, d) @ keys.transpose(-2, -1) / math.sqrt(d)  # (B, G, r, n, L, c)
    position = torch.arange(padded, device=q.device).view(num_splits, 1, c)
    allowed = position < S
    if causal:
        allowed = allowed & (position <= torch.arange(L, device=q.device).view(1, L, 1) + S - L)
    scores = scores.masked_fill(~allowed, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exps = torch.exp(scores - top)
    total = exps.sum(dim=-1, keepdim=True)
    partial_lse = (top + torch.log(total)).squeeze(-1).reshape(B, H, num_splits, L)
    partial_out = (exps @ values / total.clamp_min(torch.finfo(total.dtype).tiny)).reshape(B, H, num_splits, L, d)
    states = [(partial_out[:, :, i], partial_lse[:, :, i]) for i in range(num_splits)]
    while len(states) > 1:  # merged pairwise, as a reduction kernel would
        paired = [merge_attention_states(*a, *b) for a, b in zip(states[::2], states[1::2])]
        states = paired + states[len(paired) * 2:]
    out, lse = states[0]
    return out, lse, partial_out, partial_lse
'''}),
    Variant("token-by-token-gather-and-einsum", "paged_kv", {APPEND: '''
import math

import torch


def append_to_paged_cache(k_pages, v_pages, block_table, seq_lens, k_new, v_new):
    page_size = k_pages.shape[2]
    for b, position in enumerate(seq_lens.tolist()):
        page = int(block_table[b, position // page_size])
        k_pages[page, :, position % page_size] = k_new[b]
        v_pages[page, :, position % page_size] = v_new[b]
''', ATTENTION: '''
def paged_attention(q, k_pages, v_pages, block_table, seq_lens):
    B, H, d = q.shape
    G, page_size = k_pages.shape[1], k_pages.shape[2]
    outputs = []
    for b in range(B):
        positions = torch.arange(int(seq_lens[b]))
        pages = block_table[b, positions // page_size]
        keys, values = k_pages[pages, :, positions % page_size], v_pages[pages, :, positions % page_size]  # (n, G, d)
        scores = torch.einsum("grd,ngd->grn", q[b].view(G, H // G, d), keys) / math.sqrt(d)
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        outputs.append(torch.einsum("grn,ngd->grd", weights, values).reshape(H, d))
    return torch.stack(outputs)
'''}),
]


@pytest.mark.parametrize("variant", WRONG, ids=variant_id)
@on_every_seed()
def test_a_wrong_answer_loses_exactly_its_tests_on_every_seed(variant, seed):
    assert not variant.hidden_may_fail  # the parameters, not the seed, decide what a wrong answer loses
    names = {test.name for test in catalogue(exercises.get(variant.exercise))}
    assert variant.visible_failures | variant.hidden_failures <= names  # the names of tests that exist
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    visible, hidden = lost(results)
    assert (seed, visible) == (seed, variant.visible_failures)
    assert (seed, hidden) == (seed, variant.hidden_failures)


@pytest.mark.parametrize("variant", RIGHT, ids=variant_id)
@on_every_seed()
def test_a_right_answer_in_another_style_passes_every_test_on_every_seed(variant, seed):
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    assert (seed, failed(results)) == (seed, set())


@pytest.mark.parametrize("exercise_id", ["split_kv", "paged_kv"])
@on_every_seed()
def test_the_solution_keeps_full_marks_on_every_seed(exercise_id, seed):
    assert max_score(exercises.get(exercise_id)) == 10
    results = graded_on_seed(exercise_id, None, seed)
    assert (seed, failed(results)) == (seed, set())
    assert sum(result.points for result in results.values()) == 10


@pytest.mark.parametrize("call", ["torch.softmax(scores, dim=-1)", "scores.softmax(dim=-1)",
                                  "torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))"])
def test_the_softmax_family_is_not_allowed_in_split_kv(call):
    step = replaced("split_kv", SPLIT, ("        weights = torch.exp(scores - top)\n", f"        weights = {call}\n"))
    _, violations = grade_in_process("split_kv", learner_notebook("split_kv", {SPLIT: step}))
    assert violations and {v.name for v in violations} <= set(split_kv_definition.EXERCISE.not_allowed)


FEEDBACK = [
    ("empty-chunk-gives-nan", "split-kv-empty-chunks",
     "`split_kv_attention(q, k, v, 6) (chunks of 2+2+2+2+2+0 keys): partial_out`: "),
    ("chunks-one-key-too-long", "split-kv-causal",
     "`split_kv_attention(q, k, v, 3, causal=True) (chunks of 8+8+8 keys): partial_out`: max abs error"),
    ("merge-without-the-maximum", "merge-empty-sides", "`merge_attention_states(out_a, lse_a, out_b, lse_b): out`: "),
    ("counts-the-token-in-seq-lens", "append-changes-nothing-else",
     "`seq_lens after the call`: 3 of 3 entries differ"),
    ("writes-the-slot-in-every-page-of-the-row", "append-changes-nothing-else", "`k_pages outside the new slots`:"),
    ("reads-every-entry-of-the-table", "paged-attention-table-padding", "IndexError"),
]


@pytest.mark.parametrize("name, case, message", FEEDBACK, ids=[f[0] for f in FEEDBACK])
def test_feedback_says_precisely_what_is_wrong(name, case, message):
    variant = next(v for v in WRONG if v.name == name)
    results, _ = grade_in_process(variant.exercise, learner_notebook(variant.exercise, variant.answers))
    assert any(message in problem for problem in results[case].problems), results[case].problems


# The references against independent oracles.

def attention_oracle(q, k, v, allowed):
    """Out and lse of q (..., L, d) over k, v (..., S, d) where `allowed` (L, S), by PyTorch, in float64;
    rows that may attend nothing give 0 and -inf."""
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0) @ v
    return out, lse


def bottom_right(L: int, S: int, causal: bool) -> torch.Tensor:
    allowed = torch.ones(L, S, dtype=torch.bool)
    return allowed.tril(diagonal=S - L) if causal else allowed


SPLIT_ORACLE_CASES = [
    # B, H, H_kv, L, S, num_splits, causal
    (2, 4, 2, 1, 37, 4, False), (2, 4, 2, 1, 37, 4, True), (1, 6, 3, 5, 24, 3, True), (2, 3, 1, 2, 10, 6, False),
    (1, 2, 2, 7, 5, 2, True), (1, 4, 4, 9, 9, 1, True), (1, 8, 1, 9, 9, 4, True), (2, 2, 1, 3, 3, 7, True),
    (1, 4, 2, 4, 40, 40, False), (1, 4, 2, 6, 40, 41, True),
]


@pytest.mark.parametrize("B, H, H_kv, L, S, num_splits, causal", SPLIT_ORACLE_CASES)
def test_reference_split_kv_is_attention_over_all_keys_and_over_each_chunk(B, H, H_kv, L, S, num_splits, causal):
    q, k, v = (torch.randn(B, heads, n, 8, dtype=torch.float64) for heads, n in ((H, L), (H_kv, S), (H_kv, S)))
    out, lse, partial_out, partial_lse = SPLIT_KV[SPLIT](q, k, v, num_splits, causal=causal)
    allowed = bottom_right(L, S, causal)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    alive = allowed.any(dim=-1)  # PyTorch gives NaN where a row attends nothing; the contract 0
    torch.testing.assert_close(out[:, :, alive], expected[:, :, alive], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:, :, ~alive], torch.zeros_like(out[:, :, ~alive]))
    keys = k.index_select(1, torch.arange(H) // (H // H_kv))  # query head i reads head i // (H / H_kv)
    values = v.index_select(1, torch.arange(H) // (H // H_kv))
    torch.testing.assert_close(lse, attention_oracle(q, keys, values, allowed)[1], rtol=1e-12, atol=1e-12)
    size = math.ceil(S / num_splits)
    for split in range(num_splits):
        chunk = slice(min(split * size, S), min((split + 1) * size, S))
        chunk_out, chunk_lse = attention_oracle(q, keys[:, :, chunk], values[:, :, chunk], allowed[:, chunk])
        torch.testing.assert_close(partial_out[:, :, split], chunk_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(partial_lse[:, :, split], chunk_lse, rtol=1e-12, atol=1e-12)
    assert partial_out.dtype == partial_lse.dtype == out.dtype == lse.dtype == torch.float64


def test_reference_merge_is_attention_over_the_union_of_two_key_sets():
    q, k, v = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 12, 16, dtype=torch.float64), \
        torch.randn(3, 12, 16, dtype=torch.float64)
    everything = torch.ones(5, 12, dtype=torch.bool)
    for cut in (torch.randperm(12)[:5], torch.arange(12), torch.tensor([], dtype=torch.int64)):
        in_a = torch.zeros(12, dtype=torch.bool)
        in_a[cut] = True
        side_a = attention_oracle(q, k, v, everything & in_a)
        side_b = attention_oracle(q, k, v, everything & ~in_a)
        out, lse = SPLIT_KV[MERGE](*side_a, *side_b)
        expected_out, expected_lse = attention_oracle(q, k, v, everything)
        torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, level", [(torch.float32, 110.0), (torch.float64, 1000.0)])
def test_reference_merge_at_large_magnitudes_and_of_empty_sides(dtype, level):
    for sign in (1.0, -1.0):
        lse_a = torch.full((4,), sign * level, dtype=dtype)
        lse_b = lse_a + torch.log(torch.tensor([3.0, 1.0, 1 / 3, 1e-6], dtype=dtype))
        out_a, out_b = torch.ones(4, 2, dtype=dtype), torch.zeros(4, 2, dtype=dtype)
        out, lse = SPLIT_KV[MERGE](out_a, lse_a, out_b, lse_b)
        share_a = torch.tensor([1 / 4, 1 / 2, 3 / 4, 1 / (1 + 1e-6)], dtype=torch.float64)
        torch.testing.assert_close(out[:, 0].double(), share_a, rtol=1e-5, atol=0)
        torch.testing.assert_close(lse.double(), sign * level - torch.log(share_a), rtol=1e-7, atol=0)
    empty = torch.tensor([-math.inf, -math.inf, 2.0], dtype=dtype)
    out, lse = SPLIT_KV[MERGE](torch.full((3, 2), 5.0, dtype=dtype), empty, torch.full((3, 2), 7.0, dtype=dtype),
                               torch.tensor([-math.inf, 1.0, -math.inf], dtype=dtype))
    assert out.tolist() == [[0.0, 0.0], [7.0, 7.0], [5.0, 5.0]] and lse.tolist() == [-math.inf, 1.0, 2.0]


def gathered(pages: torch.Tensor, table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Tokens 0 .. length-1 of sequence b, one at a time: (H_kv, length, d)."""
    page_size = pages.shape[2]
    return torch.stack([pages[table[b, t // page_size], :, t % page_size] for t in range(length)], dim=1)


@pytest.mark.parametrize("page_size, H, H_kv, lengths", [(4, 4, 2, [7, 13, 4]), (1, 2, 2, [3, 1]),
                                                         (16, 8, 1, [33, 16, 1]), (3, 6, 3, [9, 10])])
def test_reference_paged_attention_is_attention_over_the_gathered_tokens(page_size, H, H_kv, lengths):
    spans = [math.ceil(n / page_size) for n in lengths]
    order = torch.randperm(sum(spans) + 3)
    table = torch.full((len(lengths), max(spans) + 2), 10**9)  # not pages: they must not be read
    start = 0
    for b, span in enumerate(spans):
        table[b, :span] = order[start:start + span]
        start += span
    k_pages, v_pages = (torch.randn(len(order), H_kv, page_size, 8, dtype=torch.float64) for _ in range(2))
    q = torch.randn(len(lengths), H, 8, dtype=torch.float64)
    out = PAGED_KV[ATTENTION](q, k_pages, v_pages, table, torch.tensor(lengths))
    for b, n in enumerate(lengths):
        keys, values = gathered(k_pages, table, b, n), gathered(v_pages, table, b, n)
        expected = F.scaled_dot_product_attention(q[b, :, None], keys, values, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[b], expected, rtol=1e-12, atol=1e-12)


def test_reference_append_writes_one_slot_per_sequence_and_nothing_else():
    k_pages, v_pages = torch.randn(9, 2, 4, 8, dtype=torch.float64), torch.randn(9, 2, 4, 8, dtype=torch.float64)
    table = torch.tensor([[5, 1, 7, 0], [2, 8, 3, 0]])
    lengths = torch.tensor([6, 8])  # page 1 slot 2; page 3 slot 0 (a new page)
    k_new, v_new = torch.randn(2, 2, 8, dtype=torch.float64), torch.randn(2, 2, 8, dtype=torch.float64)
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    for b, (page, slot) in enumerate([(1, 2), (3, 0)]):
        expected_k[page, :, slot], expected_v[page, :, slot] = k_new[b], v_new[b]
    kept_table, kept_lengths = table.clone(), lengths.clone()
    assert PAGED_KV[APPEND](k_pages, v_pages, table, lengths, k_new, v_new) is None
    assert torch.equal(k_pages, expected_k) and torch.equal(v_pages, expected_v)
    assert torch.equal(table, kept_table) and torch.equal(lengths, kept_lengths)
    assert torch.equal(gathered(k_pages, table, 1, 9)[:, 8], k_new[1])


# The hidden inputs are what their case names say, whatever the seed.

@on_every_seed()
def test_the_hidden_inputs_of_split_kv_are_what_their_case_names_say(seed):
    sent = sent_inputs("split_kv", seed)
    for case, (splits, queries, causal, layout, dtype) in SPLITS.items():
        (inputs,) = sent[f"split-kv-random[{case}]"]
        assert inputs["q"].dtype == FLOAT_DTYPES[dtype]
        H, H_kv, L, S = inputs["q"].shape[1], inputs["k"].shape[1], inputs["q"].shape[2], inputs["k"].shape[2]
        ((_, num_splits, causal_given),) = inputs["calls"]
        chunks = [stop - start for start, stop in split_kv_definition.chunk_bounds(S, num_splits)]
        assert {"one split": num_splits == 1,
                "splits dividing S": num_splits > 1 and S % num_splits == 0,
                "splits not dividing S": 1 < num_splits < S and S % num_splits and 0 not in chunks,
                "more splits than keys": num_splits > S}[splits], (case, S, num_splits)
        assert (0 in chunks) == (splits == "more splits than keys")
        assert (L == 1) == (queries == "L = 1 (decoding)") and L < S
        assert causal_given == SPLIT_TESTS.CAUSAL[causal]
        assert {"MHA": H_kv == H > 1, "GQA": 1 < H_kv < H, "MQA": H_kv == 1 < H}[kind(layout)]
    for dtype in SPLIT_TESTS.DTYPES:
        (inputs,) = sent[f"split-kv-large-scores[{dtype}]"]
        q, k = inputs["q"].double(), inputs["k"].double()
        scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-2, -1) / 4
        centre = {"float32": 96.0, "float64": 1000.0}[dtype]  # past 88.7 and 709.8, where exp overflows
        assert (scores - centre).abs().max() <= 15 / 4 and q.shape[-1] == 16
        assert torch.equal(scores, torch.round(scores * 4) / 4)  # quarters: exact in float32
        S, num_splits = inputs["k"].shape[2], inputs["calls"][0][1]
        assert S % num_splits and 0 not in [b - a for a, b in split_kv_definition.chunk_bounds(S, num_splits)]
    for case, (magnitude, dtype) in MERGES.items():
        (inputs,) = sent[f"merge-random[{case}]"]
        assert str(inputs["out_a"].dtype) == f"torch.{dtype}"
        finite = torch.cat([inputs["lse_a"].flatten(), inputs["lse_b"].flatten()])
        finite = finite[torch.isfinite(finite)]
        limit = {"float32": 88.8, "float64": 745.0}[dtype]
        assert {"ordinary lse": finite.abs().max() < 10, "large positive lse": finite.min() > limit,
                "large negative lse": finite.max() < -limit}[magnitude]
        assert not (torch.isinf(inputs["lse_a"]) & torch.isinf(inputs["lse_b"])).any()


def used_pages(inputs, b: int) -> list[int]:
    return inputs["block_table"][b, :math.ceil(int(inputs["seq_lens"][b]) / inputs["k_pages"].shape[2])].tolist()


@on_every_seed()
def test_the_hidden_inputs_of_paged_kv_are_what_their_case_names_say(seed):
    sent = sent_inputs("paged_kv", seed)
    for case, (table, ends, layout, dtype) in PAGED.items():
        (inputs,) = sent[f"paged-attention-random[{case}]"]
        assert inputs["q"].dtype == FLOAT_DTYPES[dtype]
        page_size, lengths = inputs["k_pages"].shape[2], inputs["seq_lens"].tolist()
        rows = [used_pages(inputs, b) for b in range(len(lengths))]
        assert all((n % page_size != 0) == (ends == PAST_THE_END) for n in lengths)
        if table == SORTED:
            assert all(len(row) >= 2 and row[-1] != max(row) for row in rows)
        else:
            assert all(row == sorted(row) for row in rows)
        shared = {row[0] for row in rows}
        assert (len(shared) == 1) == (table == "a shared prefix")
        every = [page for row in rows for page in row]
        listed = set(inputs["block_table"].flatten().tolist())
        assert len(set(every)) < inputs["k_pages"].shape[0] and listed <= set(range(inputs["k_pages"].shape[0]))
        H, H_kv = inputs["q"].shape[1], inputs["k_pages"].shape[1]
        assert {"MHA": H_kv == H > 1, "GQA": 1 < H_kv < H, "MQA": H_kv == 1 < H}[kind(layout)]
    for case, (ends, table, dtype) in APPENDS.items():
        (inputs,) = sent[f"append-random[{case}]"]
        assert inputs["k_pages"].dtype == FLOAT_DTYPES[dtype]
        page_size, lengths = inputs["k_pages"].shape[2], inputs["seq_lens"]
        assert all((n % page_size == 0) == (ends == "new tokens starting a page") for n in lengths.tolist())
        pages, _ = paged_kv_definition.new_slots(inputs)
        assert len(set(pages.tolist())) == len(pages)  # no two sequences write the same page
        assert all(n >= page_size for n in lengths.tolist()) or ends != "new tokens starting a page"
    for case, size in PAGED_TESTS.PAGE_SIZES.items():
        (inputs,) = sent[f"paged-attention-page-sizes[{case}]"]
        assert inputs["k_pages"].shape[2] == size
        assert (int(inputs["seq_lens"][0]) % size != 0) == (size > 1)


# The notebooks.

def source_notebook(exercise_id: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / exercises.get(exercise_id).notebook, as_version=4)


@pytest.mark.parametrize("exercise_id, pages", [("split_kv", {"split-kv", "online-softmax", "contract"}),
                                                ("paged_kv", {"paged-kv-cache", "kv-cache", "mqa-gqa", "contract"})])
def test_the_notebooks_link_their_chapters_and_import_no_other_notebook(exercise_id, pages):
    notebook = source_notebook(exercise_id)
    prose = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert set(re.findall(r"https://mha-derived\.github\.io/mha-derived/book/([a-z0-9-]+)\.html", prose)) == pages
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert not re.search(r"%run|import_ipynb|\.ipynb", code)
