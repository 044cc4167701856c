"""`flash_forward`: the online softmax and the tiled (FlashAttention) forward pass.

Besides values, three rules of the contract are graded, each in a case of its own: the block
rule (the online softmax never reduces more than one block of columns at once), memory (no
tensor created during the call larger than the inputs or one block of scores) and work (with a
causal mask, the key blocks above the diagonal are skipped, not masked). These are measured in
the learner's process. The memory and work rules are also graded from outside it, in hidden
cases too large for their measurements to be lost in noise: during a call at L = S = 4096, the
memory of the learner's processes must rise by less than all the scores would take at two
bytes each (`judge.whole_scores`), and at L = S = 2048 with the causal mask they must spend at
most the CPU time they spend without it (`judge.work_time`), so that scores kept in
blocks, or computed where the modes do not look, are caught as well.

The hidden tests are parametrised by the axes along which the contract lets inputs vary, so
that every graded run covers every value of each; the seed draws only sizes and values: for
the forward pass, L < S, L = S and L > S; lengths ragged or multiples of the blocks; causal or
not; the default blocks or given ones; each case in float32 or float64 (every value of every
axis meets both), and float16 cases of
their own (out in float16, lse in float32). Every hidden case has at least two key blocks past
the first, so that forgetting to rescale the running state shows; for the online softmax, a
row that is a multiple of the block, one with a ragged last block, and one block as wide as
the row or wider.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import pytest
import torch

from autograde.cases import FLOAT_DTYPES, Draw, Inputs, alternate_dtypes
from autograde.exercises.flash_forward import (
    DEFAULT_BLOCK,
    FORWARD,
    ONLINE,
    WORK_BLOCK,
    WORK_LENGTH,
    call_text,
    forward,
    memory_limit,
    options_of,
)
from autograde.observe import CallCost
from autograde.rules import judge
from autograde.testing import assert_rule, assert_same, observed, observed_rows, oracle
from autograde.tests.test_sdpa import bottom_right_causal

HEAD_DIMS = (16, 32, 64)
BLOCK_SIZES = (8, 16, 32, 64)
# The case whose memory is measured from outside: all its scores take 64 MiB in float32; a few
# MiB of noise (pages touched for the first time, the arguments read) stay far below the 32 MiB allowed.
# Blocks of 256, a quarter of the loop's steps that 128 takes (the solution's call 0.07-0.11 s in the
# sandbox, against 0.11-0.18 s), a block's scores (256 KiB) still a 128th of what is allowed.
WHOLE_LENGTH, WHOLE_HEAD_DIM, WHOLE_BLOCK = 4096, 16, 256
# The case whose CPU time is measured from outside (to the nanosecond, `sandbox.procfs.cpu_clock_ns`):
# large enough for the blocks' work to outweigh a call's fixed costs, about 6 ms, and heads of
# d = 128, so that a block's two products outweigh what masking it costs (the reference takes about
# 0.1 s of CPU time without the mask, 0.6-0.7x that with it; an honest answer that also masks every
# block it computes 0.7-0.8x, up to 0.82x in the median of nine pairs beside a CPU hog, where at
# d = 64 it measured 0.8-0.9x here and once 0.94x on another machine, and with -1e9 for -inf
# (whose exponentials take a slow path) once 0.93x at d = 128 beside a hog and a neighbour's tests;
# one that computes every block 1.0x and more, 1.3x and more as written). So the rule allows 1.0x,
# the causal call no dearer than the full one: a submission that computes every block spends at
# least its full call's time, and the points of a right answer with costs of its own matter more
# than those of one that also got around the FLOP count inside. Judged on the median of up to nine
# pairs (a causal call, then a full one) to ride out noise: one pair alone has swung from 0.32x to
# 1.49x for the same answer beside a hog. The calls stop once the median is settled (more than half
# of the nine on one side of WORK_TIME_RATIO), or early once WORK_TIME_CLEAR_PAIRS pairs, and most
# pairs so far, are each clearly within the rule (at most WORK_TIME_CLEAR): on a loaded machine one
# pair's ratio has come out at 0.62x of its usual value, enough to clear an answer that computes
# every block; two pairs so far off are what the early stop needs.
WORK_TIME_LENGTH, WORK_TIME_HEADS, WORK_TIME_HEAD_DIM, WORK_TIME_BLOCK = 2048, 2, 128, 128
WORK_TIME_CALLS, WORK_TIME_RATIO, WORK_TIME_CLEAR, WORK_TIME_CLEAR_PAIRS = 9, 1.0, 0.7, 2
# Both cases' values are checked on every CHECKED_ROW_STEP-th row, against the definition: all of
# them would cost the grader more than the learner's calls; a step below the blocks' rows (128,
# 256) checks a row or more of each block, at a different place in each.
CHECKED_ROW_STEP = 61

BLOCK_RULE, MEMORY_RULE, WORK_RULE = judge.reductions(ONLINE), judge.memory(FORWARD), judge.work()
KEYS_IN_BLOCKS = judge.keys_in_blocks(FORWARD)

# The axes of the hidden tests (their values are the test ids).
LENGTHS = ("L < S", "L = S", "L > S")
EDGES = ("ragged lengths", "lengths multiples of the blocks")
CAUSAL = {"causal": True, "not causal": False}
BLOCKS = ("default blocks", "given blocks")
WIDTHS = ("width a multiple of the block", "ragged last block", "one block as wide as the row or wider")
FORWARD_CASES = alternate_dtypes({f"{lengths}, {edges}, {causal}, {blocks}": (lengths, edges, causal, blocks)
                                  for lengths in LENGTHS for edges in EDGES for causal in CAUSAL for blocks in BLOCKS})
FLOAT16_CASES = {f"{lengths}, {causal}": (lengths, causal) for lengths in LENGTHS for causal in CAUSAL}
# The fewest rows per head in a hidden case, and the keys past two blocks that at least as many rows see.
FEWEST_ROWS = 16


def attention_inputs(draw: Draw, B: int, H: int, L: int, S: int, d: int, dtype: torch.dtype, **options) -> dict:
    """q, k, v drawn in `dtype`, and the call's options (causal, block sizes) as given."""
    return {"q": draw.normal(B, H, L, d, dtype=dtype), "k": draw.normal(B, H, S, d, dtype=dtype),
            "v": draw.normal(B, H, S, d, dtype=dtype), **options}


def attention_by_definition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            rows: torch.Tensor | None = None) -> tuple:
    """out and lse in float64, straight from the definition: the backward's inputs, and the Triton kernel's oracle.
    `rows`: those query rows only (indices into q's), where all of them would cost more than the case checks."""
    L, S = q.shape[-2], k.shape[-2]
    rows = torch.arange(L) if rows is None else rows
    q, k, v = q[..., rows, :].double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~bottom_right_causal(L, S)[rows], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # A row that attends nothing has lse -inf, and -inf - (-inf) is NaN: its weights are 0.
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return weights @ v, lse


def draw_lengths(draw: Draw, lengths: str, edges: str, block_q: int, block_k: int) -> tuple[int, int]:
    """(L, S) as the axes `lengths` (of LENGTHS) and `edges` (of EDGES) say, drawn until they do.

    S >= 2 * block_k + FEWEST_ROWS and L >= FEWEST_ROWS: with or without a causal mask, at least
    FEWEST_ROWS rows of each head see three key blocks or more, so a running state that is not
    rescaled shows (the key that raises a row's maximum lies past its first block).
    """
    ragged = edges == EDGES[0]
    while True:
        S = draw.integer(2 * block_k + FEWEST_ROWS, 2 * block_k + 5 * FEWEST_ROWS)
        if lengths == "L < S":
            L = draw.integer(FEWEST_ROWS, S - 1)
        elif lengths == "L > S":
            L = draw.integer(S + 1, S + 4 * FEWEST_ROWS)
        else:
            L = S
        if not ragged and lengths == "L = S":  # blocks are powers of 2: the larger is a multiple of both
            L = S = -(-S // max(block_q, block_k)) * max(block_q, block_k)
        elif not ragged:  # up to the next multiples of the blocks
            L, S = -(-L // block_q) * block_q, -(-S // block_k) * block_k
        ragged_here = L % block_q != 0 and S % block_k != 0
        multiples_here = L % block_q == 0 and S % block_k == 0
        in_order = {"L < S": L < S, "L = S": L == S, "L > S": L > S}[lengths]
        if in_order and (ragged_here if ragged else multiples_here):
            return L, S


def random_attention(draw: Draw, lengths: str, edges: str, causal: bool, blocks: str, dtype: torch.dtype) -> Inputs:
    """A hidden case of the forward pass: sizes and values from the seed, the rest from the axes."""
    given = blocks == "given blocks"
    block_q, block_k = (draw.choice(BLOCK_SIZES), draw.choice(BLOCK_SIZES)) if given else (DEFAULT_BLOCK,) * 2
    L, S = draw_lengths(draw, lengths, edges, block_q, block_k)
    options = {"causal": causal, **({"block_q": block_q, "block_k": block_k} if given else {})}
    values = attention_inputs(draw, draw.integer(1, 2), draw.integer(1, 3), L, S, draw.choice(HEAD_DIMS), dtype,
                              **options)
    return Inputs(values, rows_attending_nothing(L, S) if causal and L > S else "random sizes")


def rows_attending_nothing(L: int, S: int) -> str:
    return f"L > S: the first {L - S} rows attend nothing (out 0, lse -inf)"


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The contract's dtype of a logsumexp: float32 for float16 and bfloat16 inputs, else the inputs' own."""
    return torch.promote_types(dtype, torch.float32)


_FIRST_ARGUMENT = " (the dtype of the first tensor argument)"


def assert_attention(got, expected, inputs: Inputs) -> None:
    """`out` in q's dtype, at its tolerance, as `assert_same` holds it; `lse` in `lse_dtype(q.dtype)`, at
    that dtype's tolerance (float32's for float16 inputs: a float16 logsumexp is what this catches)."""
    q = inputs["q"]
    problems = []
    for like, ignore in ((q, ("lse",)), (torch.empty(0, dtype=lse_dtype(q.dtype)), ("out",))):
        try:
            assert_same(got, expected, like=like, ignore=ignore)
        except AssertionError as error:
            problems += str(error).splitlines()
    if lse_dtype(q.dtype) != q.dtype:
        problems = [p.replace(_FIRST_ARGUMENT, f" (for {str(q.dtype).removeprefix('torch.')} inputs, as "
                                               "FlashAttention returns it)") if p.startswith("`lse`") else p
                    for p in problems]
    if problems:
        raise AssertionError("\n".join([f"inputs: {inputs.describe()}", *problems]))


# Oracles.


@oracle(of=forward)
def forward_by_definition(inputs: Inputs) -> dict:
    """out and lse in float64 by the definition: the solution's tiles cost the grader more."""
    out, lse = attention_by_definition(inputs["q"], inputs["k"], inputs["v"], inputs.get("causal", False))
    return {"out": out, "lse": lse}


# Visible cases.

def softmax_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(3, 5, 37, scale=3.0), "block_sizes": [8, 37, 64, 1]},
                  "37 columns: blocks of 8 leave a ragged last block")


def softmax_float32_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(4, 100, dtype=torch.float32, scale=40.0), "block_sizes": [16]},
                  "scores beyond 88, where exp overflows float32 unless the running max is subtracted first")


def softmax_rule_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(4, 6, 100, dtype=torch.float32, scale=3.0), "block_size": 16},
                  "100 columns read in blocks of 16; every reduction during the call is measured")


def ragged(draw: Draw) -> Inputs:
    return Inputs(attention_inputs(draw, 2, 3, 45, 70, 16, torch.float64, causal=False, block_q=16, block_k=32),
                  "L != S, neither a multiple of its block size")


def causal_square(draw: Draw) -> Inputs:
    return Inputs(attention_inputs(draw, 2, 2, 50, 50, 32, torch.float32, causal=True, block_q=16, block_k=16),
                  "L == S, blocks that straddle the diagonal")


def causal_more_queries(draw: Draw) -> Inputs:
    return Inputs(attention_inputs(draw, 1, 3, 40, 23, 16, torch.float64, causal=True, block_q=16, block_k=8),
                  rows_attending_nothing(40, 23))


def default_blocks(draw: Draw) -> Inputs:
    return Inputs(attention_inputs(draw, 1, 2, 100, 130, 64, torch.float32), "the default blocks of 64")


def float16_inputs(draw: Draw) -> Inputs:
    return Inputs(attention_inputs(draw, 2, 2, 60, 90, 32, torch.float16, causal=True, block_q=16, block_k=32),
                  "float16 inputs: out in float16, lse in float32 (as FlashAttention returns them)")


def memory_inputs(draw: Draw) -> Inputs:
    inputs = Inputs(attention_inputs(draw, 2, 2, 192, 160, 16, torch.float32, causal=False, block_q=32, block_k=32))
    return Inputs(inputs.values, whole_scores_note(inputs))


def whole_scores_note(inputs: Inputs) -> str:
    B, H, L, _ = inputs["q"].shape
    scores, limit = B * H * L * inputs["k"].shape[-2], memory_limit(inputs)
    return f"all the scores at once would hold {scores:,} elements, {scores / limit:.3g}x the {limit:,} allowed"


def work_inputs(draw: Draw) -> Inputs:
    n = WORK_LENGTH
    return Inputs(attention_inputs(draw, 1, 1, n, n, 16, torch.float32, block_q=WORK_BLOCK, block_k=WORK_BLOCK),
                  "called with causal=False and causal=True; matmul FLOPs counted as FlopCounterMode counts them")


def whole_scores_inputs(draw: Draw, length: int = WHOLE_LENGTH) -> Inputs:
    n = length
    return Inputs(attention_inputs(draw, 1, 1, n, n, WHOLE_HEAD_DIM, torch.float32, causal=False,
                                   block_q=WHOLE_BLOCK, block_k=WHOLE_BLOCK),
                  f"L = S = {n:,}: all the scores at once take {4 * n * n / 2**20:.0f} MiB as float32")


def work_rule_settled(call: str, causal: list[CallCost], full: list[CallCost]) -> bool:
    """Whether more pairs of calls could not change the verdict, or need not: a measurement failed,
    more than half of the WORK_TIME_CALLS pairs are on one side of WORK_TIME_RATIO (the median pair
    of all of them would be too), or the pairs so far clearly meet the rule."""
    if any(cost.problem for cost in causal + full):
        return True
    within = pairs_within(call, causal, full, WORK_TIME_RATIO)
    majority = WORK_TIME_CALLS // 2 + 1
    return within >= majority or len(causal) - within >= majority or clearly_within_work_rule(call, causal, full)


def clearly_within_work_rule(call: str, causal: list[CallCost], full: list[CallCost]) -> bool:
    """Whether the pairs of calls so far clear the rule without more: at least WORK_TIME_CLEAR_PAIRS of
    them, and more than half, each within WORK_TIME_CLEAR on its own (so the median pair is too). A
    first pair slowed where its causal call met memory the process had not used yet does not decide."""
    clear = pairs_within(call, causal, full, WORK_TIME_CLEAR)
    return clear >= WORK_TIME_CLEAR_PAIRS and 2 * clear > len(causal)


def pairs_within(call: str, causal: list[CallCost], full: list[CallCost], allowed: float) -> int:
    """How many pairs of calls are each within `allowed` on their own."""
    return sum(not judge.work_time(call, [one_causal], [one_full], allowed)
               for one_causal, one_full in zip(causal, full, strict=True))


def work_time_inputs(draw: Draw, length: int = WORK_TIME_LENGTH) -> Inputs:
    n = length
    return Inputs(attention_inputs(draw, 1, WORK_TIME_HEADS, n, n, WORK_TIME_HEAD_DIM, torch.float32, causal=True,
                                   block_q=WORK_TIME_BLOCK, block_k=WORK_TIME_BLOCK),
                  f"L = S = {n:,}: called with causal=True and causal=False alternately, up to {WORK_TIME_CALLS} "
                  "times each; CPU time measured from outside your process")


def with_causal(inputs: Inputs, causal: bool) -> Inputs:
    return Inputs({**inputs.values, "causal": causal}, inputs.note)


def assert_attention_rows(got: dict, inputs: Inputs, rows: torch.Tensor) -> None:
    """`assert_attention` on `rows` of out and lse only, against the definition."""
    q = inputs["q"]
    out, lse = attention_by_definition(q, inputs["k"], inputs["v"], inputs["causal"], rows)
    checked = Inputs(inputs.values, f"{inputs.note}; out and lse checked on {len(rows)} rows, every "
                                     f"{int(rows[1] - rows[0])}th from row 0")
    try:
        got = observed_rows(got, {"out": q.shape, "lse": q.shape[:-1]}, rows, axis=2)
    except AssertionError as error:
        raise AssertionError(f"inputs: {checked.describe()}\n{error}") from None
    assert_attention(got, observed({"out": out, "lse": lse}), checked)


def assert_whole_scores_kept(measured_call: Callable[[], CallCost], call: str, inputs: Inputs) -> None:
    """`measured_call()` makes the call measured from outside, checks what it returned and gives its
    cost. Where that breaks the whole-scores rule, the call is made and checked once more and, if it
    returns the right values, the second judged: what one measurement may add (pages touched by the
    allocator or the interpreter's collector, more on some machines than on others) need not recur,
    while a stored score matrix is there at every call. A second call that fails leaves the first's
    problems standing."""
    B, H, L, _ = inputs["q"].shape
    scores = B * H * L * inputs["k"].shape[-2]
    problems = judge.whole_scores(call, measured_call(), scores)
    if problems:
        with contextlib.suppress(Exception):
            problems = judge.whole_scores(call, measured_call(), scores)
    if problems:
        raise AssertionError("\n".join([f"inputs: {inputs.describe()}", *problems]))


# Hidden cases: one per value of each axis (the parameters); sizes and values from the seed.

def softmax_random(draw: Draw, width: str) -> Inputs:
    """In float64; the test casts them to float32 too."""
    if width == "width a multiple of the block":
        block_size = draw.choice([1, 2, 4, 8, 16])
        columns = block_size * draw.integer(2, 8)
    elif width == "ragged last block":
        block_size = draw.integer(2, 16)
        columns = block_size * draw.integer(1, 5) + draw.integer(1, block_size - 1)
    else:
        columns = draw.integer(1, 64)
        block_size = columns + draw.choice([0, draw.integer(1, 32)])
    x = draw.normal(draw.integer(1, 3), draw.integer(1, 4), columns, scale=10.0)
    return Inputs({"x": x, "block_sizes": [block_size]}, f"{columns} columns in blocks of {block_size}")


# The tests.

@pytest.mark.points(1.0)
@pytest.mark.uses(ONLINE)
def test_online_softmax(submission, reference, draw):
    """the softmax of each row, computed in one pass over column blocks"""
    inputs = softmax_inputs(draw)
    got, expected = submission.softmaxes(inputs), reference.softmaxes(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(ONLINE)
def test_online_softmax_large_scores(submission, reference, draw):
    """large float32 scores neither overflow nor give NaN"""
    inputs = softmax_float32_inputs(draw)
    got, expected = submission.softmaxes(inputs), reference.softmaxes(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(ONLINE)
def test_online_softmax_rule(submission, reference, draw):
    """block rule: no reduction combines more than block_size columns

    What makes the softmax online: it reads each row one block of columns at a time, so no
    max, sum, matrix product or other reduction during the call combines more values than one
    block holds. This rule is measured by a dispatch mode in the learner's own process, and is
    therefore advisory: code that switches the mode off would not be caught by it.
    """
    inputs = softmax_rule_inputs(draw)
    got, expected = submission.softmax_reductions(inputs), reference.softmax_reductions(inputs)
    assert_rule(got, expected, BLOCK_RULE, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_ragged(submission, reference, draw):
    """out and lse when L and S are not multiples of the blocks"""
    inputs = ragged(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_causal(submission, reference, draw):
    """out and lse with the causal mask, L == S"""
    inputs = causal_square(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_causal_more_queries(submission, reference, draw):
    """rows that attend nothing give out 0 and lse -inf"""
    inputs = causal_more_queries(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_forward_default_blocks(submission, reference, draw):
    """the default block sizes"""
    inputs = default_blocks(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_forward_float16(submission, reference, draw):
    """float16 inputs: out in float16, lse in float32"""
    inputs = float16_inputs(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_memory_rule(submission, reference, draw):
    """no tensor larger than the inputs or one block of scores

    Measured with it, and not graded: whether a reduction combined more values than a block of keys
    or a head's width. The contract bounds the memory only, so such a forward keeps its points and
    its grade goes to review, for a person to see whether it reads the keys block by block.
    """
    inputs = memory_inputs(draw)
    got, expected = submission.forward_memory(inputs), reference.forward_memory(inputs)
    if isinstance(got, dict) and (reason := KEYS_IN_BLOCKS(expected, got)):
        submission.for_review(reason)
    assert_rule(got, expected, MEMORY_RULE, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_work_rule(submission, reference, draw):
    """causal: blocks above the diagonal skipped (at most 0.6x the FLOPs)"""
    inputs = work_inputs(draw)
    got, expected = submission.forward_work(inputs), reference.forward_work(inputs)
    assert_rule(got, expected, WORK_RULE, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("width", WIDTHS, ids=WIDTHS)
@pytest.mark.points(0.5)
@pytest.mark.uses(ONLINE)
def test_online_softmax_random(submission, reference, draw, width):
    """random sizes and block sizes, in float32 and float64"""
    drawn = softmax_random(draw, width)
    for inputs in (drawn.cast(torch.float32), drawn):
        got, expected = submission.softmaxes(inputs), reference.softmaxes(inputs)
        assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("lengths, edges, causal, blocks, dtype", list(FORWARD_CASES.values()), ids=list(FORWARD_CASES))
@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_random(submission, reference, draw, lengths, edges, causal, blocks, dtype):
    """L < S, L = S, L > S; ragged or not; causal or not; default or given blocks; float32 or float64"""
    drawn = random_attention(draw, lengths, edges, CAUSAL[causal], blocks, torch.float64)
    inputs = drawn.cast(FLOAT_DTYPES[dtype])
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.parametrize("lengths, causal", list(FLOAT16_CASES.values()), ids=list(FLOAT16_CASES))
@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_forward_float16_random(submission, reference, draw, lengths, causal):
    """float16 inputs, ragged lengths and given blocks: L < S, L = S, L > S, causal or not"""
    inputs = random_attention(draw, lengths, EDGES[0], CAUSAL[causal], "given blocks", torch.float16)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_attention(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_whole_scores_measured_from_outside(submission, draw):
    """L = S = 4096: memory measured from outside your process stays below what all the scores take"""
    submission.forward(whole_scores_inputs(draw, 2 * WHOLE_BLOCK))  # code run for the first time, not measured
    inputs = whole_scores_inputs(draw)

    def measured_call() -> CallCost:
        with submission.cost_measured() as peak:
            got = submission.forward(inputs)
        assert_attention_rows(got, inputs, torch.arange(0, inputs["q"].shape[-2], CHECKED_ROW_STEP))
        return peak

    assert_whole_scores_kept(measured_call, call_text(FORWARD, "q, k, v", options_of(inputs)), inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_work_measured_from_outside(submission, draw):
    """causal, L = S = 2048: CPU time measured from outside your process at most 1.0x that without the mask"""
    submission.forward(work_time_inputs(draw, 2 * WORK_TIME_BLOCK))  # code run for the first time, not measured
    inputs = work_time_inputs(draw)
    blocks = {name: value for name, value in options_of(inputs).items() if name != "causal"}
    call = call_text(FORWARD, "q, k, v", blocks)
    costs: dict[bool, list[CallCost]] = {True: [], False: []}
    for pairs in range(1, WORK_TIME_CALLS + 1):
        for causal in (True, False):
            called = with_causal(inputs, causal)
            with submission.cost_measured(memory=False) as cost:
                got = submission.forward(called)
            costs[causal].append(cost)
            if len(costs[causal]) == 1:
                assert_attention_rows(got, called, torch.arange(0, inputs["q"].shape[-2], CHECKED_ROW_STEP))
        if work_rule_settled(call, costs[True], costs[False]):
            break
    problems = judge.work_time(call, costs[True], costs[False], WORK_TIME_RATIO)
    if problems:
        raise AssertionError("\n".join([f"inputs: {inputs.describe()}", *problems]))
