"""The exercise `window`: graded end to end, wrong answers caught (each losing exactly its tests on several
seeds), a right one in another style accepted, and the reference checked against oracles that are not the
course's code: PyTorch's own attention under a mask built key by key, with the sink as one more key whose
value is 0, and a cache's kept tokens listed from the whole sequence.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autograde import registry as exercises
from autograde import solutions
from autograde.cases import FLOAT_DTYPES, Draw
from autograde.grading import batch
from autograde.grading.sandboxed import SandboxedSubmission
from autograde.grading.session import catalogue, max_score
from autograde.sandbox import client as sandbox
from autograde.submission import extract
from autograde.tests import test_window as TESTS
from tests.fixtures.implementations import Variant, cases, fs, variant_id
from tests.fixtures.notebooks import (
    ROOT,
    SEED,
    STORAGE,
    failed,
    graded_on_seed,
    learner_notebook,
    lost,
    on_every_seed,
    replaced,
    sent_inputs,
)

pytestmark = pytest.mark.timeout(300)

WINDOW = solutions.namespace(exercises.get("window"))
MASK, ATTENTION, CACHE = "sliding_window_mask", "windowed_attention", "RollingKVCache"


# End to end: the instructor's grader, in its sandboxed worker.

def test_the_solution_scores_full_marks_and_the_release_scores_0(tmp_path: Path):
    submitted = tmp_path / "submitted"
    shutil.copytree(ROOT / "solutions" / "windows", submitted / "ada" / "windows")
    shutil.copytree(ROOT / "exercises" / "windows", submitted / "bert" / "windows")
    rows = batch.grade_all(submitted, SEED, jobs=2, assignments=["windows"], progress=False)
    scores = {(student, g.exercise.id): (g.status, g.score, g.max_score) for student, g in rows}
    assert scores == {("ada", "window"): ("graded", 10, 10), ("bert", "window"): ("graded", 0, 10)}


# Wrong answers lose exactly the tests they break; a right answer in another style passes.

MASKS, ATTENTIONS, CACHES = TESTS.MASK_CASES, TESTS.ATTENTION_CASES, TESTS.CACHE_CASES
INSIDE_OR_ONE = ("window inside the sequence", "window 1")
# A sink logit of +1000 leaves the keys nothing: any answer that gets the keys wrong still outputs 0 there.
SEEN = "very positive sink logits"
NOTHING = "L > S (rows that see nothing)"


def sink_shows(window: str, queries: str, sinks: str, dtype: str) -> bool:
    """Where a sink whose value is not 0 shows: a sink logit within reach of the scores, or any sink logit
    on a row that sees nothing (the sink alone in its softmax)."""
    return sinks in ("ordinary sink logits", SEEN) or (sinks != "no sink logits" and queries == NOTHING)


LOOP = "        for t in range(k.shape[2]):\n"  # the head of append's loop
RETURN = "    return weights @ v / total"  # windowed_attention's last line


def sink_added(term: str) -> str:
    """windowed_attention's last line, with `term` (the sink's part) added to the numerator."""
    return f"    out = weights @ v\n    if sink_logits is not None:\n        out = out + {term}\n    return out / total"


SLOT = "slot = position if position < self.sinks else self.sinks + (position - self.sinks) % self.window"

WRONG = [
    # j >= i + S - L - window: window + 1 keys a row; a window as long as the keys cannot tell.
    Variant("window-off-by-one", "window",
            {MASK: replaced("window", MASK, ("(keys > last - window)", "(keys >= last - window)"))},
            fs("sliding-window-mask", "windowed-attention", "windowed-attention-after-a-cache", "sink-logits"),
            cases("mask-random", MASKS, lambda window, queries: window in INSIDE_OR_ONE)
            | cases("attention-random", ATTENTIONS,
                    lambda window, queries, sinks, dtype: window in INSIDE_OR_ONE and sinks != SEEN)),
    # The band measured from the top-left corner, as if the queries were the first L keys.
    Variant("top-left-alignment", "window", {MASK: replaced(
        "window", MASK, ("last = torch.arange(L)[:, None] + (S - L)", "last = torch.arange(L)[:, None]"))},
        fs("sliding-window-mask", "windowed-attention-after-a-cache", "sink-logits"),
        cases("mask-random", MASKS, lambda window, queries: queries != "L = S")
        | cases("attention-random", ATTENTIONS,
                lambda window, queries, sinks, dtype: queries != "L = S" and sinks != SEEN)),
    # A ring over every slot: the first tokens are overwritten like any other.
    Variant("evicting-the-sinks", "window",
            {CACHE: replaced("window", CACHE, (SLOT, "slot = position % (self.sinks + self.window)"))},
            fs("rolling-cache"), cases("cache-random", CACHES, lambda sinks, *_: sinks == "sinks")),
    # The sink's exp(s) added to the numerator as well as the denominator, as if its value were all ones.
    Variant("sink-logit-in-the-numerator", "window", {ATTENTION: replaced(
        "window", ATTENTION, (RETURN, sink_added("torch.exp(sink - top)")))},
        fs("sink-logits"),
        cases("attention-random", ATTENTIONS, sink_shows)),
    # The sink read as the first token: its value is v's first key instead of 0.
    Variant("sink-value-not-zero", "window", {ATTENTION: replaced(
        "window", ATTENTION, (RETURN, sink_added("torch.exp(sink - top) * v[..., :1, :]")))},
        fs("sink-logits"),
        cases("attention-random", ATTENTIONS, sink_shows)),
    # Past the last slot every token lands in it; a window of 1 has only that slot and cannot tell.
    Variant("ring-index-not-wrapped", "window", {CACHE: replaced(
        "window", CACHE, (SLOT, "slot = min(position, self.sinks + self.window - 1)"))},
        fs("rolling-cache"),
        cases("cache-random", CACHES, lambda sinks, chunks, window, dtype: window != "window 1")),
    # Positions counted within the cache (0, 1, ...), not the absolute ones RoPE rotated the keys by.
    Variant("wrapped-slots-positions-wrong", "window", {CACHE: replaced(
        "window", CACHE, ("self.positions[order]", "torch.arange(len(order))"))},
        fs("rolling-cache"), cases("cache-random", CACHES, lambda *axes: True)),
    # Right keys and values, but every token appended is kept as well: the memory measured from outside shows it.
    Variant("keeps-every-token", "window", {CACHE: replaced(
        "window", CACHE, (LOOP, "        self.seen = getattr(self, 'seen', []) + [k, v]\n" + LOOP))},
        fs("cache-storage"),
        cases("cache-random", CACHES, lambda *axes: True) | STORAGE),
    # Right keys and values, in new tensors at every append. Its peak memory lies between the solution's and
    # the outside case's bound (3.4-3.9x the slots through the sandbox); in this test process, whose heap the
    # earlier tests have cut up, it may cross it. The checks in the worker are the ones that must catch it.
    Variant("allocates-at-every-append", "window", {CACHE: replaced(
        "window", CACHE, (LOOP, "        self.k, self.v = self.k.clone(), self.v.clone()\n" + LOOP))},
        fs("cache-storage"), cases("cache-random", CACHES, lambda *axes: True),
        hidden_may_fail=STORAGE),
]

RIGHT = [
    Variant("triangles-a-sink-column-and-one-store", "window", {MASK: '''
import torch


def sliding_window_mask(L, S, window):
    # Below the bottom-right diagonal and at most window - 1 below it.
    return torch.ones(L, S, dtype=torch.bool).tril(S - L).triu(S - L - window + 1)
''', ATTENTION: '''
def windowed_attention(q, k, v, window, sink_logits=None):
    # The sink as one more key: its score s_h, its value 0.
    scores = torch.einsum("...ld,...sd->...ls", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~sliding_window_mask(q.shape[-2], k.shape[-2], window), float("-inf"))
    values = v
    if sink_logits is not None:
        column = sink_logits.to(scores).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
        values = torch.cat([v, torch.zeros_like(v[..., :1, :])], dim=-2)
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = (scores - peak).exp()
    denominator = weights.sum(dim=-1, keepdim=True)
    return torch.einsum("...ls,...sd->...ld", weights, values) / torch.where(
        denominator > 0, denominator, torch.ones_like(denominator))
''', CACHE: '''
class RollingKVCache:
    def __init__(self, batch, kv_heads, window, head_dim, sinks=0, dtype=torch.float32):
        self.sinks, self.window, self.count = sinks, window, 0
        self.store = torch.zeros(2, batch, kv_heads, sinks + window, head_dim, dtype=dtype)
        self.where = torch.zeros(sinks + window, dtype=torch.int64)

    def append(self, k, v):
        n = k.shape[2]
        positions = torch.arange(self.count, self.count + n)
        # Of a chunk longer than the window, only the sinks and the last `window` tokens survive.
        keep = (positions < self.sinks) | (positions >= self.count + n - self.window)
        positions = positions[keep]
        slots = torch.where(positions < self.sinks, positions, self.sinks + (positions - self.sinks) % self.window)
        self.store[0][:, :, slots] = k[:, :, keep]
        self.store[1][:, :, slots] = v[:, :, keep]
        self.where[slots] = positions
        self.count += n

    def keys_values(self):
        filled = min(self.count, self.sinks + self.window)  # slots fill in order: 0, 1, ...
        order = self.where[:filled].argsort()
        return self.store[0][:, :, order], self.store[1][:, :, order], self.where[:filled][order]
'''}),
]


@pytest.mark.parametrize("variant", WRONG, ids=variant_id)
@on_every_seed()
def test_a_wrong_answer_loses_exactly_its_tests_on_every_seed(variant, seed):
    names = {test.name for test in catalogue(exercises.get(variant.exercise))}
    assert variant.visible_failures | variant.hidden_failures <= names  # the names of tests that exist
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    visible, hidden = lost(results)
    assert (seed, visible) == (seed, variant.visible_failures)
    assert variant.hidden_failures <= hidden <= variant.hidden_failures | variant.hidden_may_fail, (seed, hidden)


@pytest.mark.parametrize("variant", RIGHT, ids=variant_id)
@on_every_seed()
def test_a_right_answer_in_another_style_passes_every_test_on_every_seed(variant, seed):
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    assert (seed, failed(results)) == (seed, set())


@on_every_seed()
def test_the_solution_keeps_full_marks_on_every_seed(seed):
    assert max_score(exercises.get("window")) == 10
    results = graded_on_seed("window", None, seed)
    assert (seed, failed(results)) == (seed, set())
    assert sum(result.points for result in results.values()) == 10


def outside_growth(answers: dict[str, str], seed: int) -> float:
    """The memory the hidden storage case measures from outside the sandboxed worker, on `seed`'s inputs,
    over the bytes of the cache's slots."""
    cells = extract.code_cells(learner_notebook("window", answers))
    submission = SandboxedSubmission(exercises.get("window"), [(c.number, c.source) for c in cells],
                                     sandbox.Limits(wall_seconds=120))
    try:
        draw = Draw(seed)
        submission.filled(TESTS.outside_inputs(draw, window=64))  # run once, not measured
        inputs = TESTS.outside_inputs(draw)
        with submission.cost_measured() as cost:
            submission.filled(inputs)
    finally:
        submission.close()
    assert not cost.problem, cost.problem
    return cost.growth_bytes / ((inputs["sinks"] + inputs["window"]) * TESTS.token_bytes(inputs))


@pytest.mark.slow
def test_the_outside_storage_case_separates_right_from_wrong_by_wide_margins_on_five_seeds():
    """Measured in the sandbox as graded: the solution's cache gains about 1.5x its slots' bytes, one that
    keeps every token 11x; the rule allows 6x."""
    keeps = next(variant for variant in WRONG if variant.name == "keeps-every-token")
    growth = {name: [outside_growth(answers, seed) for seed in range(1, 6)]
              for name, answers in (("solution", {}), ("keeps-every-token", keeps.answers))}
    assert max(growth["solution"]) <= TESTS.OUTSIDE_ALLOWED / 2, growth
    assert min(growth["keeps-every-token"]) >= 1.5 * TESTS.OUTSIDE_ALLOWED, growth


# The reference against oracles.

def mask_oracle(L: int, S: int, window: int) -> torch.Tensor:
    """Key by key, from the contract's sentence: query i sees key j when i + S - L - window < j <= i + S - L."""
    return torch.tensor([[i + S - L - window < j <= i + S - L for j in range(S)] for i in range(L)])


@pytest.mark.parametrize("L, S, window", [(6, 6, 3), (3, 8, 3), (8, 5, 2), (5, 5, 1), (4, 4, 10), (1, 9, 4),
                                          (7, 7, 7), (2, 2, 1)])
def test_reference_mask_is_the_contract_key_by_key(L, S, window):
    assert torch.equal(WINDOW[MASK](L, S, window), mask_oracle(L, S, window))


@pytest.mark.parametrize("L, S, window", [(6, 6, 3), (3, 10, 4), (8, 5, 2), (5, 5, 1), (4, 4, 10)])
@pytest.mark.parametrize("sinks", [None, (-1.5, 0.0, 2.0), (-1000.0, -1000.0, -1000.0), (1000.0, 1000.0, 1000.0)])
def test_reference_attention_is_pytorch_with_the_sink_as_a_key_of_value_0(L, S, window, sinks):
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (L, S, S))
    allowed = mask_oracle(L, S, window)
    sink_logits = None if sinks is None else torch.tensor(sinks, dtype=torch.float64)
    out = WINDOW[ATTENTION](q, k, v, window, sink_logits=sink_logits)
    if sink_logits is None:
        keys, values, mask = k, v, allowed.expand(2, 3, L, S)
        scale = None
    else:
        # A key whose score against every query is s_h: scores are q.k / sqrt(d), so scale is 1 and q.k is
        # pre-divided; the sink key is the unit vector of an extra dimension where every query holds s_h.
        scale = 1.0
        q = torch.cat([q / 8 ** 0.5, sink_logits.view(1, 3, 1, 1).expand(2, 3, L, 1)], dim=-1)
        keys = torch.cat([torch.cat([k, torch.zeros(2, 3, S, 1, dtype=torch.float64)], dim=-1),
                          torch.cat([torch.zeros(2, 3, 1, 8, dtype=torch.float64),
                                     torch.ones(2, 3, 1, 1, dtype=torch.float64)], dim=-1)], dim=-2)
        values = torch.cat([v, torch.zeros(2, 3, 1, 8, dtype=torch.float64)], dim=-2)
        mask = torch.cat([allowed, torch.ones(L, 1, dtype=torch.bool)], dim=-1).expand(2, 3, L, S + 1)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    alive = mask.any(dim=-1)  # PyTorch gives NaN where a row attends nothing; the contract 0
    torch.testing.assert_close(out[alive], expected[alive], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~alive], torch.zeros_like(out[~alive]))


@pytest.mark.parametrize("window, sinks, chunks", [(4, 2, [1] * 13), (3, 0, [5, 1, 7]), (1, 1, [2, 1, 3]),
                                                    (5, 3, [2, 9, 1, 1])])
def test_reference_cache_keeps_the_sinks_and_the_last_window_tokens(window, sinks, chunks):
    T = sum(chunks)
    k, v = torch.randn(2, 3, T, 4, dtype=torch.float64), torch.randn(2, 3, T, 4, dtype=torch.float64)
    cache, start = WINDOW[CACHE](2, 3, window, 4, sinks=sinks, dtype=torch.float64), 0
    for size in chunks:
        cache.append(k[:, :, start:start + size], v[:, :, start:start + size])
        start += size
        kept = [p for p in range(start) if p < sinks or p >= start - window]
        keys, values, positions = cache.keys_values()
        assert positions.tolist() == kept and positions.dtype == torch.int64
        assert torch.equal(keys, k[:, :, kept]) and torch.equal(values, v[:, :, kept])


def window_is(kind: str, size: int, S: int) -> bool:
    return {"window 1": size == 1, "window >= S": size >= S}.get(kind, 1 < size < S)


def queries_are(kind: str, L: int, S: int) -> bool:
    return {"L = S": L == S, "L < S (after a cache)": L < S}.get(kind, L > S)


@pytest.mark.parametrize("seed", [SEED, 1])
def test_the_hidden_inputs_are_what_their_case_names_say(seed):
    sent = sent_inputs("window", seed)
    for case, (window, queries) in MASKS.items():
        (inputs,) = sent[f"mask-random[{case}]"]
        assert all(window_is(window, size, S) and queries_are(queries, L, S) for L, S, size in inputs["shapes"])
    for case, (window, queries, sinks, dtype) in ATTENTIONS.items():
        (inputs,) = sent[f"attention-random[{case}]"]
        assert inputs["q"].dtype == FLOAT_DTYPES[dtype]
        L, S = inputs["q"].shape[-2], inputs["k"].shape[-2]
        assert window_is(window, inputs["window"], S) and queries_are(queries, L, S)
        logits = inputs.get("sink_logits")
        assert (logits is None) == (sinks == "no sink logits")
        if sinks == "very negative sink logits":
            assert bool((logits <= -TESTS.EXTREME_SINK).all())
        if sinks == SEEN:
            assert bool((logits >= TESTS.EXTREME_SINK).all())
    for case, (sinks, chunks, window, dtype) in CACHES.items():
        (inputs,) = sent[f"cache-random[{case}]"]
        size, recorded = inputs["window"], inputs["chunks"]
        assert inputs["k"].dtype == TESTS.DTYPES[dtype] and (size == 1) == (window == "window 1")
        assert (inputs["sinks"] > 0) == (sinks == "sinks")
        assert set(recorded) == {1} if chunks == "token by token" else min(recorded) > size
        assert sum(recorded) + sum(inputs["more"]) >= max(10 * size, inputs["sinks"] + size + 1)


def test_the_notebook_links_its_chapter_and_imports_no_other_notebook():
    text = (ROOT / "solutions" / "windows" / "window.ipynb").read_text()
    assert "book/sliding-windows.html" in text and "book/contract.html" in text
    assert "import_notebook" not in text and "%run" not in text
