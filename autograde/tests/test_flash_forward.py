"""`flash_forward`: the online softmax and the tiled (FlashAttention) forward pass.

Besides values, two rules of the contract are graded, each in a case of its own: memory (no
tensor created during the call larger than the inputs or one block of scores) and work
(with a causal mask, the key blocks above the diagonal are skipped, not masked).
"""

from __future__ import annotations

import pytest
import torch

from autograde import rules
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX, Draw, Exercise, Inputs
from autograde.sandbox.observe import pair
from autograde.testing import adapter, assert_rule, assert_same

ONLINE, FORWARD = "online_softmax", "flash_attention_forward"
OPTIONS = ("causal", "block_q", "block_k")
DEFAULT_BLOCK = 64
HEAD_DIMS = (16, 32, 64)
BLOCK_SIZES = (8, 16, 32, 64)
WORK_LENGTH, WORK_BLOCK, WORK_RATIO = 1024, 64, 0.6

MEMORY_RULE, LARGEST, MEMORY_LIMIT = rules.memory(FORWARD)
WORK_RULE, CAUSAL_FLOPS, FULL_FLOPS, RATIO_ALLOWED = rules.work()


def attention_inputs(draw: Draw, B: int, H: int, L: int, S: int, d: int, dtype: torch.dtype, **options) -> dict:
    """q, k, v drawn in `dtype`, and the call's options (causal, block sizes) as given."""
    return {"q": draw.normal(B, H, L, d, dtype=dtype), "k": draw.normal(B, H, S, d, dtype=dtype),
            "v": draw.normal(B, H, S, d, dtype=dtype), **options}


def call_text(function: str, arguments: str, options: dict) -> str:
    return f"{function}({arguments}{''.join(f', {name}={value!r}' for name, value in options.items())})"


def options_of(inputs: Inputs) -> dict:
    return {name: inputs[name] for name in OPTIONS if name in inputs.values}


def memory_limit(inputs: Inputs) -> int:
    """max(q.numel(), k.numel(), v.numel(), B*H*block_q*block_k), the memory rule's bound."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    B, H = q.shape[:2]
    block_q, block_k = inputs.get("block_q", DEFAULT_BLOCK), inputs.get("block_k", DEFAULT_BLOCK)
    return max(q.numel(), k.numel(), v.numel(), B * H * block_q * block_k)


def forward_call(functions, inputs: Inputs, **override) -> tuple:
    options = {**options_of(inputs), **override}
    result = functions.flash_attention_forward(inputs["q"], inputs["k"], inputs["v"], **options)
    return pair(result, call_text(FORWARD, "q, k, v", options), "(out, lse)")


def rows_attending_nothing(L: int, S: int) -> str:
    return f"L > S: the first {L - S} rows attend nothing (out 0, lse -inf)"


# Probes.

@adapter
def softmaxes(functions, inputs: Inputs) -> dict:
    return {f"online_softmax(x, {size})": functions.online_softmax(inputs["x"], size) for size in inputs["block_sizes"]}


@adapter
def forward(functions, inputs: Inputs) -> dict:
    out, lse = forward_call(functions, inputs)
    return {"out": out, "lse": lse}


@adapter
def forward_memory(functions, inputs: Inputs) -> dict:
    with rules.Footprint() as footprint:
        out, lse = forward_call(functions, inputs)
    return {"out": out, "lse": lse, LARGEST: footprint.largest, MEMORY_LIMIT: memory_limit(inputs)}


@adapter
def forward_work(functions, inputs: Inputs) -> dict:
    flops = {}
    for causal in (False, True):
        with rules.Footprint() as footprint:
            out, lse = forward_call(functions, inputs, causal=causal)
        flops[causal] = footprint.matmul_flops
    return {"out": out, "lse": lse, CAUSAL_FLOPS: flops[True], FULL_FLOPS: flops[False], RATIO_ALLOWED: WORK_RATIO}


# Visible cases.

def softmax_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(3, 5, 37, scale=3.0), "block_sizes": [8, 37, 64, 1]},
                  "37 columns: blocks of 8 leave a ragged last block")


def softmax_float32_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(4, 100, dtype=torch.float32, scale=40.0), "block_sizes": [16]},
                  "scores beyond 88, where exp overflows float32 unless the running max is subtracted first")


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


# Hidden cases: sizes, blocks, dtypes drawn from the instructor's seed.

def softmax_random(draw: Draw) -> Inputs:
    columns = draw.integer(1, 90)
    x = draw.normal(draw.integer(1, 4), columns, dtype=draw.choice([torch.float32, torch.float64]), scale=10.0)
    return Inputs({"x": x, "block_sizes": [draw.integer(1, columns), draw.choice(BLOCK_SIZES)]}, "random sizes")


def random_sizes(draw: Draw) -> Inputs:
    values = attention_inputs(draw, draw.integer(1, 3), draw.integer(1, 3), draw.integer(1, 100), draw.integer(1, 100),
                              draw.choice(HEAD_DIMS), draw.choice([torch.float32, torch.float64]),
                              causal=draw.choice([False, True]), block_q=draw.choice(BLOCK_SIZES),
                              block_k=draw.choice(BLOCK_SIZES))
    return Inputs(values, "random sizes, blocks and dtype")


def random_more_queries(draw: Draw) -> Inputs:
    S = draw.integer(1, 40)
    L = S + draw.integer(1, 40)
    values = attention_inputs(draw, draw.integer(1, 2), draw.integer(1, 3), L, S, draw.choice(HEAD_DIMS),
                              draw.choice([torch.float32, torch.float64]), causal=True,
                              block_q=draw.choice(BLOCK_SIZES), block_k=draw.choice(BLOCK_SIZES))
    return Inputs(values, rows_attending_nothing(L, S))


EXERCISE = Exercise(
    id="flash_forward",
    assignment="flash",
    title="Online softmax and the tiled forward pass",
    required=(ONLINE, FORWARD),
    not_allowed=NOT_ALLOWED_ATTENTION + NOT_ALLOWED_SOFTMAX,
)


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


@pytest.mark.points(1.5)
@pytest.mark.uses(FORWARD)
def test_forward_ragged(submission, reference, draw):
    """out and lse when L and S are not multiples of the blocks"""
    inputs = ragged(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_causal(submission, reference, draw):
    """out and lse with the causal mask, L == S"""
    inputs = causal_square(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_causal_more_queries(submission, reference, draw):
    """rows that attend nothing give out 0 and lse -inf"""
    inputs = causal_more_queries(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(FORWARD)
def test_forward_default_blocks(submission, reference, draw):
    """the default block sizes"""
    inputs = default_blocks(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_memory_rule(submission, reference, draw):
    """no tensor larger than the inputs or one block of scores"""
    inputs = memory_inputs(draw)
    got, expected = submission.forward_memory(inputs), reference.forward_memory(inputs)
    assert_rule(got, expected, MEMORY_RULE, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_work_rule(submission, reference, draw):
    """causal: blocks above the diagonal skipped (at most 0.6x the FLOPs)"""
    inputs = work_inputs(draw)
    got, expected = submission.forward_work(inputs), reference.forward_work(inputs)
    assert_rule(got, expected, WORK_RULE, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(ONLINE)
def test_online_softmax_random(submission, reference, draw):
    """random sizes and block sizes"""
    inputs = softmax_random(draw)
    got, expected = submission.softmaxes(inputs), reference.softmaxes(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_random(submission, reference, draw):
    """random sizes, blocks, dtypes, causal or not"""
    inputs = random_sizes(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(FORWARD)
def test_forward_random_more_queries(submission, reference, draw):
    """causal with L > S, random sizes"""
    inputs = random_more_queries(draw)
    got, expected = submission.forward(inputs), reference.forward(inputs)
    assert_same(got, expected, inputs)
