"""The flash exercises: the references agree with PyTorch, the grader gives the solutions full marks
on every seed and the release 0, and wrong answers lose exactly the tests they break, rules included.

The rules (block, memory, work, saved tensors, Triton launch) are graded by measuring the
learner's call, so the wrong answers here include ones with the right values and the wrong
method. The hidden tests are parametrised by the contract's axes (lengths, edges, causal,
blocks, dtype), so what a wrong answer loses does not depend on the seed: every one is graded
on several seeds and must lose exactly its tests on each. Answers run in this process, as in
`test_exercises_wrong`; their cells are registered with `linecache` as in the worker, because
Triton reads a kernel's source when it decorates it. One command-line run grades a small
class through the sandboxed worker.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autograde import registry as exercises
from autograde import solutions
from autograde.cases import FLOAT_DTYPES
from autograde.frontends import check as self_check
from autograde.grading import grade
from autograde.grading.session import catalogue, max_score
from autograde.observe import CallCost, Submission
from autograde.rules import judge, measure
from autograde.tests import test_flash_backward as BACKWARD_TESTS
from autograde.tests import test_flash_forward as FORWARD_TESTS
from autograde.tests import test_flash_triton as TRITON_TESTS
from tests.fixtures.implementations import (
    FULL_MATRIX_FORWARD,
    LSE_IN_128_ROW_BLOCKS,
    PADDED_INPUTS_COPIED,
    PADDED_INPUTS_SLICED,
    QUERY_CHUNKED_FORWARD,
    Variant,
    variant_id,
)
from tests.fixtures.notebooks import (
    MEASURED_HERE,
    ROOT,
    SEED,
    WHOLE,
    WORK_TIME,
    answer,
    failed,
    graded_and_reviewed,
    graded_on_seed,
    learner_notebook,
    lost,
    on_every_seed,
    run_cells,
    sent_inputs,
    write,
)

pytestmark = pytest.mark.timeout(120)


# The visible tests of values; the rules are tests of their own, which wrong values do not fail.
FORWARD_VALUES = {"forward-ragged", "forward-causal", "forward-causal-more-queries", "forward-default-blocks",
                  "forward-float16"}
BACKWARD_VALUES = {"backward-ragged", "backward-causal", "backward-causal-more-queries", "backward-float16"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The grader's worker runs one thread: the blocks are many small operations, for which a
    second thread on a shared machine mostly waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replaced(source: str, *pairs: tuple[str, str]) -> str:
    """`source` with each `old` replaced by `new`, which must be there: a variant never silently equals the
    reference."""
    for old, new in pairs:
        assert old in source, old
        source = source.replace(old, new)
    return source


def cases(test: str, table: dict[str, tuple], keep=lambda *axes: True) -> frozenset[str]:
    """The report names of the cases of a parametrised test (`table`: id -> axes) whose axes `keep` accepts."""
    return frozenset(f"{test}[{case}]" for case, axes in table.items() if keep(*axes))


FORWARD_RANDOM, FLOAT16_RANDOM = FORWARD_TESTS.FORWARD_CASES, FORWARD_TESTS.FLOAT16_CASES
BACKWARD_RANDOM, APPLY_RANDOM = BACKWARD_TESTS.BACKWARD_CASES, BACKWARD_TESTS.APPLY_CASES
TRITON_RANDOM = TRITON_TESTS.TRITON_CASES
RAGGED = FORWARD_TESTS.EDGES[0]
EVERY_FORWARD_CASE = cases("forward-random", FORWARD_RANDOM) | cases("forward-float16-random", FLOAT16_RANDOM)
EVERY_BACKWARD_CASE = cases("backward-random", BACKWARD_RANDOM) | cases("backward-float16-random", FLOAT16_RANDOM)

FORWARD = answer("flash_forward", "flash_attention_forward")
BACKWARD = answer("flash_backward", "flash_attention_backward")
FUNCTION = answer("flash_backward", "FlashAttention")
KERNEL = answer("flash_triton", "flash_attention_kernel")
WRAPPER = answer("flash_triton", "flash_attention_triton")

PLAIN_SOFTMAX = """import math

import torch


def online_softmax(x, block_size):
    exps = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return exps / exps.sum(dim=-1, keepdim=True)
"""


FULL_MATRIX_BACKWARD = """
def flash_attention_backward(q, k, v, out, lse, dout, causal=False, block_q=64, block_k=64):
    L, S = q.shape[-2], k.shape[-2]
    dtype, state = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, out, lse, dout = (t.to(state) for t in (q, k, v, out, lse, dout))
    scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        visible = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
        scores = scores.masked_fill(~visible, -math.inf)
    p = torch.exp(scores - torch.where(lse == -math.inf, math.inf, lse)[..., None])
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(dim=-1, keepdim=True))
    grads = (ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout)
    return tuple(grad.to(dtype) for grad in grads)
"""

# Autograd through attention recomputed eight query rows at a time: right gradients, every tensor
# within the memory rule, and not the exercise.
AUTOGRAD_BACKWARD = """
def flash_attention_backward(q, k, v, out, lse, dout, causal=False, block_q=64, block_k=64):
    L, S = q.shape[-2], k.shape[-2]
    dtype, state = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, dout = (t.detach().to(state) for t in (q, k, v, dout))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    with torch.enable_grad():
        k, v = k.requires_grad_(), v.requires_grad_()
        for start in range(0, L, 8):
            rows = q[:, :, start:start + 8].detach().requires_grad_()
            scores = rows @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if causal:
                where = torch.arange(start, start + rows.shape[-2])
                scores = scores.masked_fill(torch.arange(S)[None, :] > where[:, None] + (S - L), -math.inf)
            top = scores.amax(dim=-1, keepdim=True).detach()
            weights = torch.exp(scores - torch.where(top == -math.inf, 0.0, top))
            total = weights.sum(dim=-1, keepdim=True)
            chunk = (weights / torch.where(total == 0, 1.0, total)) @ v
            grads = torch.autograd.grad(chunk, (rows, k, v), dout[:, :, start:start + 8])
            dq[:, :, start:start + 8] = grads[0]
            dk += grads[1]
            dv += grads[2]
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
"""

TORCH_INSTEAD_OF_TRITON = FULL_MATRIX_FORWARD.replace(
    "def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):",
    "def flash_attention_triton(q, k, v, causal=False):")

# Attention in PyTorch, its results then copied into out and lse by a Triton kernel.
COPIED_BY_A_KERNEL = FULL_MATRIX_FORWARD.replace(
    "def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):",
    "def attention_in_pytorch(q, k, v, causal=False):") + """

@triton.jit
def copy_kernel(Source, Target, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Target + offsets, tl.load(Source + offsets, mask=offsets < n), mask=offsets < n)


def flash_attention_triton(q, k, v, causal=False):
    results = attention_in_pytorch(q, k, v, causal)
    copies = tuple(torch.empty_like(result) for result in results)
    for result, copy in zip(results, copies):
        copy_kernel[(triton.cdiv(result.numel(), 1024),)](result, copy, result.numel(), BLOCK=1024)
    return copies
"""

WRONG = [
    # Right values, computed over the whole row at once.
    Variant("plain-softmax", "flash_forward", {"online_softmax": PLAIN_SOFTMAX},
            frozenset({"online-softmax-rule"}),
            message="block rule broken: one reduction in online_softmax combined 100 values (amax of a tensor of "
                    "shape (4, 6, 100)), more than the block_size=16 columns of one block"),
    # For float16 inputs, a logsumexp rounded to float16; float32 and float64 are unchanged.
    Variant("lse-in-the-inputs-dtype", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, ("lse = torch.empty((B, H, L), dtype=state, device=q.device)",
                  "lse = torch.empty((B, H, L), dtype=q.dtype, device=q.device)"))},
        frozenset({"forward-float16"}), cases("forward-float16-random", FLOAT16_RANDOM),
        message="`lse`: expected dtype torch.float32 (for float16 inputs, as FlashAttention returns it), "
                "got torch.float16"),
    Variant("no-accumulator-rescale", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, ("acc = acc * rescale + p @ v", "acc = acc + p @ v"))},
        frozenset(FORWARD_VALUES), EVERY_FORWARD_CASE | WHOLE | WORK_TIME, message="`out`: max abs error"),
    # The last, partial block of queries is never computed.
    Variant("whole-query-blocks-only", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, ("for q_start in range(0, L, block_q):", "for q_start in range(0, L - block_q + 1, block_q):"))},
        frozenset(FORWARD_VALUES), cases("forward-random", FORWARD_RANDOM, lambda lengths, edges, *_: edges == RAGGED)
        | cases("forward-float16-random", FLOAT16_RANDOM), message="`out`: max abs error"),
    # Query i attends key j iff j <= i: right only when L == S.
    Variant("top-left-causal-mask", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, ("diagonal = S - L  #", "diagonal = 0  #"))},
        frozenset({"forward-causal-more-queries", "forward-float16"}),
        cases("forward-random", FORWARD_RANDOM, lambda lengths, edges, causal, blocks, dtype: causal == "causal"
              and lengths != "L = S")
        | cases("forward-float16-random", FLOAT16_RANDOM, lambda lengths, causal: causal == "causal"
                and lengths != "L = S"),
        message="`out`: max abs error"),
    Variant("lse-without-the-scale", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, ("q_block = q[:, :, q_start:q_end].to(state) * scale", "q_block = q[:, :, q_start:q_end].to(state)"),
        ("p = torch.exp(scores - shift)", "p = torch.exp((scores - shift) * scale)"),
        ("rescale = torch.exp(row_max - shift)", "rescale = torch.exp((row_max - shift) * scale)"))},
        frozenset(FORWARD_VALUES), EVERY_FORWARD_CASE | WHOLE | WORK_TIME, message="`lse`: max abs error"),
    Variant("full-score-matrix", "flash_forward", {"flash_attention_forward": FULL_MATRIX_FORWARD},
        frozenset({"memory-rule", "work-rule"}), WHOLE | WORK_TIME,
        message="memory rule broken: the largest tensor created by flash_attention_forward holds 122,880 "
                "elements, 10x the 12,288 allowed"),
    Variant("masks-instead-of-skipping", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, ("k_stop = min(S, q_end + diagonal) if causal else S", "k_stop = S"))},
        frozenset({"work-rule"}), WORK_TIME,
        message="work rule broken: with causal=True the forward spends 67,108,864 matmul FLOPs, 1x the "
                "67,108,864 of causal=False; at most 0.6x is allowed (the reference: 0.531x)"),
    # D summed over one key block: right only where a row sees a single key block.
    Variant("D-from-one-key-block", "flash_backward", {"flash_attention_backward": replaced(
        BACKWARD, ("ds = p * (dout_block @ v_block.transpose(-2, -1) - delta[:, :, q_start:q_end])",
                   "dp = dout_block @ v_block.transpose(-2, -1)\n            ds = p * (dp - (p * dp).sum(dim=-1, "
                   "keepdim=True))"))},
        frozenset(BACKWARD_VALUES), EVERY_BACKWARD_CASE | cases("flash-attention-apply-random", APPLY_RANDOM),
        message="`dq`: max abs error"),
    # float16 inputs and a float32 lse mixed in one product.
    Variant("backward-in-the-inputs-dtype", "flash_backward", {"flash_attention_backward": replaced(
        BACKWARD, ("    q, k, v, out, lse, dout = (t.to(state) for t in (q, k, v, out, lse, dout))\n", ""))},
        frozenset({"backward-float16"}), cases("backward-float16-random", FLOAT16_RANDOM),
        message="RuntimeError: "),
    Variant("full-score-matrix-backward", "flash_backward", {"flash_attention_backward": FULL_MATRIX_BACKWARD},
        frozenset({"backward-memory-rule"}), WHOLE,
        message="memory rule broken: the largest tensor created by flash_attention_backward holds 122,880 "
                "elements, 10x the 12,288 allowed"),
    Variant("autograd-through-row-chunks", "flash_backward", {"flash_attention_backward": AUTOGRAD_BACKWARD},
        frozenset({"backward-memory-rule", "flash-attention-apply"}),
        cases("flash-attention-apply-random", APPLY_RANDOM) | WHOLE,  # its graphs raise the memory by 175 MiB
        message="hand-written backward rule broken: during flash_attention_backward, autograd recorded a graph"),
    Variant("saves-the-probabilities", "flash_backward", {"FlashAttention": replaced(
        FUNCTION, ("ctx.save_for_backward(q, k, v, out, lse)",
                   "p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - lse[..., None])\n"
                   "        ctx.save_for_backward(q, k, v, out, lse, p)"),
        ("q, k, v, out, lse = ctx.saved_tensors", "q, k, v, out, lse, p = ctx.saved_tensors"))},
        frozenset({"saved-tensors-rule"}), WHOLE,
        message="saved-tensors rule broken: FlashAttention's forward saves q, k, v, out, lse, a tensor of shape "
                "(1, 2, 24, 24); it must save exactly q, k, v, out, lse"),
    # Keys past S score 0; a causal mask hides them anyway.
    Variant("triton-ragged-keys-score-0", "flash_triton", {"flash_attention_kernel": replaced(
        KERNEL, ("""        visible = cols[None, :] < S
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
        scores = tl.where(visible, scores, float("-inf"))""", """        if CAUSAL:
            scores = tl.where(cols[None, :] <= rows[:, None] + diagonal, scores, float("-inf"))"""))},
        frozenset({"triton-ragged"}), cases("triton-random", TRITON_RANDOM,
                                            lambda lengths, edges, causal: edges == RAGGED and causal == "not causal"),
        message="`out`: max abs error"),
    Variant("attention-in-pytorch", "flash_triton", {"flash_attention_triton": TORCH_INSTEAD_OF_TRITON},
        frozenset(c.name for c in catalogue(exercises.get("flash_triton")) if c.visible),
        frozenset(c.name for c in catalogue(exercises.get("flash_triton")) if not c.visible),
        message="Triton rule broken: flash_attention_triton launched 0 Triton kernels"),
    Variant("attention-in-pytorch-copied-by-a-kernel", "flash_triton", {"flash_attention_triton": COPIED_BY_A_KERNEL},
        frozenset(c.name for c in catalogue(exercises.get("flash_triton")) if c.visible),
        frozenset(c.name for c in catalogue(exercises.get("flash_triton")) if not c.visible),
        message="Triton rule broken: outside its kernels, flash_attention_triton combined"),
]

RIGHT = [
    # The kernel's results copied into another layout and back before they are returned.
    Variant("results-copied-after-the-kernel", "flash_triton", {"flash_attention_triton": replaced(
        WRAPPER, ("    return out.reshape(B, H, L, d), lse.reshape(B, H, L)",
                  "    out = out.reshape(B, H, L, d).transpose(1, 2).contiguous().transpose(1, 2)\n"
                  "    return out, lse.reshape(B, H, L).clone()"))}),
    # Blocks from `split`, maxima from `max(dim)`, sums as products with a column of ones.
    Variant("split-and-matmul-sums", "flash_forward", {"online_softmax": """import math

import torch


def online_softmax(x, block_size):
    state = torch.promote_types(x.dtype, torch.float32)
    peak = total = None
    for block in x.to(state).split(block_size, dim=-1):
        ones = torch.ones(block.shape[-1], 1, dtype=state, device=x.device)
        block_peak = block.max(dim=-1, keepdim=True).values
        new_peak = block_peak if peak is None else torch.maximum(peak, block_peak)
        block_total = torch.exp(block - new_peak) @ ones
        total = block_total if total is None else total * torch.exp(peak - new_peak) + block_total
        peak = new_peak
    return (torch.exp(x.to(state) - peak) / total).to(x.dtype)
"""}),
    Variant("einsum-one-head-at-a-time", "flash_forward", {"flash_attention_forward": """
def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):
    B, H, L, d = q.shape
    S = k.shape[2]
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    out = torch.zeros_like(q)
    lse = torch.full((B, H, L), -math.inf, dtype=wide)
    for b in range(B):
        for h in range(H):
            for i0 in range(0, L, block_q):
                rows = torch.arange(i0, min(i0 + block_q, L))
                m = torch.full((len(rows),), -math.inf, dtype=wide)
                total = torch.zeros(len(rows), dtype=wide)
                acc = torch.zeros(len(rows), d, dtype=wide)
                last = min(S, rows[-1].item() + 1 + S - L) if causal else S
                for j0 in range(0, max(last, 0), block_k):
                    cols = torch.arange(j0, min(j0 + block_k, last))
                    s = torch.einsum("id,jd->ij", q[b, h, rows].to(wide), k[b, h, cols].to(wide)) * d ** -0.5
                    if causal:
                        s = torch.where(cols[None, :] <= rows[:, None] + (S - L), s, -math.inf)
                    m_new = torch.maximum(m, s.max(dim=1).values)
                    safe = torch.nan_to_num(m_new, neginf=0.0)
                    p = torch.exp(s - safe[:, None])
                    total = total * torch.exp(m - safe) + p.sum(dim=1)
                    acc = acc * torch.exp(m - safe)[:, None] + torch.einsum("ij,jd->id", p, v[b, h, cols].to(wide))
                    m = m_new
                seen = total > 0
                normalised = acc / torch.where(seen, total, 1.0)[:, None]
                out[b, h, rows] = torch.where(seen[:, None], normalised, 0.0).to(q.dtype)
                lse[b, h, rows] = torch.where(seen, m + torch.log(torch.where(seen, total, 1.0)), -math.inf)
    return out, lse
"""}),
    Variant("function-keeps-tensors-on-ctx", "flash_backward", {"FlashAttention": """
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        out, lse = flash_attention_forward(q, k, v, causal=causal)
        ctx.tensors, ctx.causal = (q, k, v, out, lse), causal
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*flash_attention_backward(*ctx.tensors, dout, causal=ctx.causal), None)
"""}),
]


def grade_in_process(exercise_id: str, answers: dict[str, str]):
    exercise = exercises.get(exercise_id)
    namespace = run_cells(learner_notebook(exercise_id, answers))
    results, violations, _ = self_check.run_in_kernel(exercise, namespace, SEED)
    return {result.name: result for result in results}, violations


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", WRONG, ids=variant_id)
@on_every_seed()
def test_a_wrong_answer_loses_exactly_its_tests_on_every_seed(variant, seed):
    assert not variant.hidden_may_fail  # the parameters, not the seed, decide what a wrong answer loses
    names = {test.name for test in catalogue(exercises.get(variant.exercise))}
    assert variant.visible_failures | variant.hidden_failures <= names  # the names of tests that exist
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    visible, hidden = lost(results)
    assert (seed, visible) == (seed, variant.visible_failures)
    assert (seed, hidden - (MEASURED_HERE - variant.hidden_failures)) == (seed, variant.hidden_failures)
    first = next(results[c.name] for c in catalogue(exercises.get(variant.exercise)) if c.name in visible)
    assert any(problem.startswith(variant.message) for problem in first.problems), first.problems


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", RIGHT, ids=variant_id)
@on_every_seed()
def test_a_right_answer_in_another_style_passes_every_test_on_every_seed(variant, seed):
    results, reviews = graded_and_reviewed(variant.exercise, variant.answers, seed)
    assert (seed, failed(results) - MEASURED_HERE, reviews) == (seed, set(), [])


@on_every_seed()
def test_attention_by_query_chunks_keeps_its_points_and_is_sent_for_review(seed):
    """The contract bounds the forward's memory, which a few query rows over every key keep; the
    tiled forward's intent, keys read block by block, is measured and shown to a person."""
    results, reviews = graded_and_reviewed("flash_forward", {"flash_attention_forward": QUERY_CHUNKED_FORWARD}, seed)
    # Every test measured in this process; the hidden cases measured from outside, in the sandbox below.
    assert (seed, failed(results) - (WHOLE | WORK_TIME)) == (seed, set())
    assert len(reviews) == 1 and reviews[0].startswith("flash_attention_forward combined 160 values in one "), reviews


def test_check_tells_the_learner_what_goes_to_review():
    namespace = run_cells(learner_notebook("flash_forward", {"flash_attention_forward": QUERY_CHUNKED_FORWARD}))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        self_check.check("flash_forward", "flash_attention_forward", namespace)
    notes = [line for line in printed.getvalue().splitlines() if line.startswith("note for review: ")]
    assert notes and notes[0].startswith("note for review: flash_attention_forward combined 160 values"), notes
    assert "FAIL" not in printed.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_attention_by_query_chunks_is_graded_review_through_the_sandbox(tmp_path: Path):
    """Its points are the tests': the memory it touches at L = S = 4096, measured from outside, sits
    near what the whole-scores case allows (a chunk of rows over all 4096 keys at a time), and its
    causal calls' CPU time below the work case's 1.0 of the full ones', but not far (it skips the
    keys past each chunk, but with causal=True builds and applies a mask over every chunk's scores:
    medians 0.80-0.91 on a quiet machine, 0.68-0.83 beside a process spinning on the other core), so
    those cases may go either way; the status is review whatever they give."""
    graded = grade.grade_notebook(write(learner_notebook(
        "flash_forward", {"flash_attention_forward": QUERY_CHUNKED_FORWARD}), tmp_path / "ada" / "flash"
        / "flash_forward.ipynb"), exercises.get("flash_forward"), SEED)
    lost_here = {result.name for result in graded.results if not result.passed}
    assert graded.status == grade.REVIEW and lost_here <= WHOLE | WORK_TIME, graded.reason
    assert graded.reason.startswith("flash_attention_forward combined 160 values in one reduction (")


# Kernels whose results are views, slices or copies of part of what a launch stored, as the contract allows.
PART_OF_WHAT_A_LAUNCH_STORED = [
    Variant("lse-in-a-buffer-of-128-row-blocks", "flash_triton", LSE_IN_128_ROW_BLOCKS),
    Variant("padded-inputs-sliced-outputs", "flash_triton", PADDED_INPUTS_SLICED),
    Variant("padded-inputs-copied-outputs", "flash_triton", PADDED_INPUTS_COPIED),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", PART_OF_WHAT_A_LAUNCH_STORED, ids=variant_id)
@on_every_seed()
def test_a_kernel_returning_part_of_what_it_stored_keeps_full_marks_on_every_seed(variant, seed):
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    assert (seed, failed(results)) == (seed, set())
    assert sum(result.points for result in results.values()) == pytest.approx(10)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_returning_part_of_what_they_stored_keep_full_marks_through_the_sandbox(tmp_path: Path):
    """Graded as a class is, beside the copy of a PyTorch result through a kernel, which loses."""
    exercise = exercises.get("flash_triton")
    answers = {variant.name: variant.answers for variant in PART_OF_WHAT_A_LAUNCH_STORED}
    answers["copied-by-a-kernel"] = {"flash_attention_triton": COPIED_BY_A_KERNEL}
    grades = {name: grade.grade_notebook(write(learner_notebook("flash_triton", answer), tmp_path / name / "flash"
                                               / "flash_triton.ipynb"), exercise, SEED)
              for name, answer in answers.items()}
    copied = grades.pop("copied-by-a-kernel")
    for name, graded in grades.items():
        assert (name, graded.status, graded.score) == (name, grade.GRADED, pytest.approx(10)), graded.reason
    assert copied.status == grade.GRADED and copied.score < 1, copied.reason
    assert "Triton rule broken: outside its kernels" in " ".join(p for r in copied.results for p in r.problems)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("exercise_id", ["flash_forward", "flash_backward", "flash_triton"])
@on_every_seed()
def test_the_solution_keeps_full_marks_on_every_seed(exercise_id, seed):
    assert max_score(exercises.get(exercise_id)) == 10
    results, reviews = graded_and_reviewed(exercise_id, None, seed)
    assert (seed, failed(results), reviews) == (seed, set(), [])
    assert sum(result.points for result in results.values()) == pytest.approx(10)


def test_softmax_is_not_allowed_in_the_source_nor_hidden(tmp_path: Path):
    header = "import math\n\nimport torch\n\n\n"
    in_source = header + "def online_softmax(x, block_size):\n    return torch.softmax(x, dim=-1)\n"
    notebook = write(learner_notebook("flash_forward", {"online_softmax": in_source}), tmp_path / "answer.ipynb")
    result = grade.grade_notebook(notebook, exercises.get("flash_forward"), SEED)
    assert (result.status, result.score) == (grade.NOT_ALLOWED, 0)
    assert result.reason.startswith("uses torch.softmax (cell ")

    hidden = header + ("def online_softmax(x, block_size):\n"
                       "    return getattr(x, 'soft' + 'max')(dim=-1)\n")
    _, violations = grade_in_process("flash_forward", {"online_softmax": hidden})
    assert [v.name for v in violations] == ["torch.softmax"]  # the operator underneath, by its family's name


@pytest.mark.timeout(300)
def test_the_grader_gives_the_solutions_full_marks_and_the_release_0(tmp_path: Path):
    """Through the command line and the sandboxed worker, which interprets Triton without a GPU."""
    submitted, out = tmp_path / "submitted", tmp_path / "grades"
    for exercise_id in ("flash_forward", "flash_backward", "flash_triton"):
        write(learner_notebook(exercise_id), submitted / "ada" / "flash" / f"{exercise_id}.ipynb")
        write(learner_notebook(exercise_id, blank=True), submitted / "bert" / "flash" / f"{exercise_id}.ipynb")
    process = subprocess.run(
        [sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out), "--seed", str(SEED),
         "--jobs", "2", "--assignment", "flash"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert process.returncode == 0, process.stderr[-3000:]
    rows = {(r["student"], r["exercise"]): r for r in csv.DictReader((out / "grades.csv").open())}
    for exercise_id in ("flash_forward", "flash_backward", "flash_triton"):
        assert (rows["ada", exercise_id]["score"], rows["ada", exercise_id]["status"]) == ("10", "graded"), \
            rows["ada", exercise_id]["reason"]
        assert rows["bert", exercise_id]["score"] == "0"


# The references against PyTorch: an oracle that is not the course's code.

FORWARD_REF = solutions.namespace(exercises.get("flash_forward"))
BACKWARD_REF = solutions.namespace(exercises.get("flash_backward"))
TRITON_REF = solutions.namespace(exercises.get("flash_triton"))

SHAPES = [
    # B, H, L, S, d, causal, block_q, block_k
    (2, 3, 45, 70, 16, False, 16, 32),
    (1, 2, 50, 50, 32, True, 16, 16),
    (2, 1, 40, 23, 64, True, 16, 8),   # L > S: 17 rows attend nothing
    (1, 1, 23, 40, 16, True, 8, 64),
    (1, 2, 1, 1, 16, True, 64, 64),
    (2, 2, 7, 3, 32, True, 4, 2),
]


def pytorch_attention(q, k, v, causal):
    """out and lse by F.scaled_dot_product_attention with a bottom-right aligned mask, and torch.logsumexp."""
    L, S = q.shape[-2], k.shape[-2]
    mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L) if causal else None
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores if mask is None else scores.masked_fill(~mask, -math.inf), dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.where(torch.isinf(lse)[..., None], 0.0, out), lse  # SDPA gives NaN where the contract gives 0


def random_qkv(B, H, L, S, d, dtype=torch.float64, requires_grad=False):
    generator = torch.Generator().manual_seed(L * 1000 + S * 10 + d)
    return [torch.randn(B, H, n, d, generator=generator, dtype=dtype).requires_grad_(requires_grad)
            for n in (L, S, S)]


def test_reference_online_softmax_is_the_softmax():
    x = 20 * torch.randn(3, 4, 37, dtype=torch.float64)
    for block_size in (1, 8, 37, 64):
        torch.testing.assert_close(FORWARD_REF["online_softmax"](x, block_size), torch.softmax(x, dim=-1))


@pytest.mark.parametrize("B, H, L, S, d, causal, block_q, block_k", SHAPES)
def test_reference_forward_and_backward_agree_with_pytorch(B, H, L, S, d, causal, block_q, block_k):
    q, k, v = random_qkv(B, H, L, S, d, requires_grad=True)
    expected_out, expected_lse = pytorch_attention(q, k, v, causal)
    out, lse = FORWARD_REF["flash_attention_forward"](q.detach(), k.detach(), v.detach(), causal, block_q, block_k)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    dout = torch.randn_like(out)
    expected = torch.autograd.grad((expected_out * dout).sum(), (q, k, v))
    grads = BACKWARD_REF["flash_attention_backward"](q.detach(), k.detach(), v.detach(), out, lse, dout, causal,
                                                     block_q, block_k)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_reference_function_gradients_agree_with_autograd():
    q, k, v = random_qkv(2, 2, 40, 33, 16, requires_grad=True)
    for causal in (False, True):
        expected_out, _ = pytorch_attention(q, k, v, causal)
        out = BACKWARD_REF["FlashAttention"].apply(q, k, v, causal)
        torch.testing.assert_close(out, expected_out)
        assert all(torch.allclose(a, b) for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                                                         torch.autograd.grad(expected_out.sum(), (q, k, v))))


@pytest.mark.parametrize("B, H, L, S, d, causal", [(1, 2, 64, 64, 16, False), (2, 1, 45, 70, 32, False),
                                                   (1, 1, 40, 23, 64, True), (1, 2, 33, 97, 16, True)])
def test_reference_triton_kernel_agrees_with_pytorch(B, H, L, S, d, causal):
    q, k, v = random_qkv(B, H, L, S, d, dtype=torch.float32)
    out, lse = TRITON_REF["flash_attention_triton"](q, k, v, causal)
    expected_out, expected_lse = pytorch_attention(q.double(), k.double(), v.double(), causal)
    torch.testing.assert_close(out, expected_out.float())
    torch.testing.assert_close(lse, expected_lse.float())


def test_the_reference_keeps_the_rules_with_room_to_spare():
    """The measured numbers the notebooks and the feedback quote."""
    q, k, v = random_qkv(1, 1, 1024, 1024, 16, dtype=torch.float32)
    flops = {}
    for causal in (False, True):
        with measure.MatmulFlops() as counted:
            FORWARD_REF["flash_attention_forward"](q, k, v, causal)
        flops[causal] = counted.matmul_flops
    assert flops[True] / flops[False] == 136 / 256  # 16 x 16 blocks of 64, the diagonal and below

    q, k, v = random_qkv(2, 2, 192, 160, 16, dtype=torch.float32)
    with measure.Footprint() as footprint:
        out, lse = FORWARD_REF["flash_attention_forward"](q, k, v, block_q=32, block_k=32)
    assert footprint.largest == q.numel()  # out and q's scaled blocks; a block of scores is 4,096
    dout = torch.randn_like(out)
    with measure.Footprint() as footprint:
        BACKWARD_REF["flash_attention_backward"](q, k, v, out, lse, dout, block_q=32, block_k=32)
    assert footprint.largest == q.numel()


@pytest.mark.parametrize("torch_has_get_kernel", [True, False], ids=["in-the-dispatcher", "before-torch-2.9"])
def test_matmul_flops_are_counted_as_flopcountermode_counts_them(monkeypatch, torch_has_get_kernel):
    from torch.utils.flop_counter import FlopCounterMode

    if not torch_has_get_kernel:
        monkeypatch.delattr(torch.library, "get_kernel")
    q, k, v = random_qkv(2, 1, 100, 80, 16)
    forward = FORWARD_REF["flash_attention_forward"]
    with measure.MatmulFlops() as counted:
        forward(q, k, v, True, 32, 16)
        torch.matmul(q[0, 0], k[0, 0].T, out=torch.empty(100, 80, dtype=q.dtype))
        with torch.inference_mode():
            torch.addmm(torch.zeros(100, 80, dtype=q.dtype), q[0, 0], k[0, 0].T)
    with FlopCounterMode(display=False) as counter:
        forward(q, k, v, True, 32, 16)
        torch.matmul(q[0, 0], k[0, 0].T, out=torch.empty(100, 80, dtype=q.dtype))
        with torch.inference_mode():
            torch.addmm(torch.zeros(100, 80, dtype=q.dtype), q[0, 0], k[0, 0].T)
    assert counted.matmul_flops == counter.get_total_flops() > 0


def test_matmul_flops_count_every_product_and_way_of_calling_it_and_nothing_else():
    """Each of FlopCounterMode's products, its out= overload, under inference_mode, in another thread,
    inside a dispatch mode; the kernels are the operators' own again afterwards."""
    a, b, batched = torch.randn(10, 6), torch.randn(6, 4), torch.randn(3, 10, 6)
    one = 2 * 10 * 6 * 4
    with measure.MatmulFlops() as counted:
        torch.mm(a, b)
        torch.addmm(torch.zeros(10, 4), a, b)
        torch.bmm(batched, b.expand(3, 6, 4))
        torch.baddbmm(torch.zeros(3, 10, 4), batched, b.expand(3, 6, 4))
        torch.matmul(a, b, out=torch.empty(10, 4))
        with torch.inference_mode():
            a @ b
        worker = threading.Thread(target=torch.mm, args=(a, b))
        worker.start()
        worker.join()
        with measure.Footprint():
            a @ b
        (a * 2).sum()
    assert counted.matmul_flops == (1 + 1 + 3 + 3 + 1 + 1 + 1 + 1) * one
    with measure.MatmulFlops() as nothing:
        pass
    torch.mm(a, b)
    assert nothing.matmul_flops == 0 and counted.matmul_flops == 12 * one


def test_footprint_counts_every_tensor_an_operator_returns():
    """One tensor, a tuple of them (values and indices), or a list of views (a split): each is measured,
    views for the largest tensor only."""
    a = torch.randn(10, 6)
    with measure.Footprint() as pair:
        torch.sort(a, dim=0)
    with measure.Footprint() as views:
        torch.split(a, 4)
    with measure.Footprint() as one:
        a @ a.T
    assert (pair.largest, pair.produced) == (60, 120)
    assert (views.largest, views.produced) == (24, 0)
    assert (one.largest, one.produced) == (100, 100)


def test_the_measuring_modes_import_no_torch_compile_and_measure_compiled_code_as_eager_code():
    """Where torch._dynamo is not loaded (the grading process, the fork server), a measuring mode's first
    use does not load it (a second of CPU time each); code compiled inside a measured call, which loads
    it, is measured as the same code run eagerly is."""
    measured = subprocess.run([sys.executable, "-c", """if True:
        import sys, torch
        from autograde.rules import measure
        def attention(q, k):
            return torch.softmax(q @ k.T, dim=-1)
        q, k = torch.randn(64, 16), torch.randn(128, 16)
        with (measure.Footprint() as eager, measure.MatmulFlops() as eager_flops,
              measure.Reductions() as eager_reductions):
            attention(q, k)
        assert "torch._dynamo" not in sys.modules, "a measuring mode loaded torch._dynamo"
        with (measure.Footprint() as compiled, measure.MatmulFlops() as compiled_flops,
              measure.Reductions() as compiled_reductions):
            attention_compiled = torch.compile(attention, backend="eager")
            attention_compiled(q, k)
        assert "torch._dynamo" in sys.modules
        assert compiled.largest == eager.largest == 8192
        assert compiled_flops.matmul_flops == eager_flops.matmul_flops == 262144
        assert compiled_reductions.widest == eager_reductions.widest == 128
    """], capture_output=True, text=True, timeout=300)
    assert measured.returncode == 0, measured.stderr[-3000:]


def work_pairs(*ratios: float) -> tuple[list[CallCost], list[CallCost]]:
    """Pairs of calls (causal, full) whose CPU times have these ratios."""
    causal = [CallCost("here", cpu_seconds=0.1 * ratio) for ratio in ratios]
    return causal, [CallCost("here", cpu_seconds=0.1) for _ in ratios]


def test_the_work_case_stops_once_its_median_pair_is_settled_and_judges_that_pair():
    """Up to WORK_TIME_CALLS pairs: the calls stop early when two pairs and most so far are clearly within
    the rule, or once more than half of all the pairs could make are on one side of it."""
    def settled(*ratios: float) -> bool:
        return FORWARD_TESTS.work_rule_settled("f(q, k, v)", *work_pairs(*ratios))

    def judged(*ratios: float) -> list[str]:
        return judge.work_time("f(q, k, v)", *work_pairs(*ratios), FORWARD_TESTS.WORK_TIME_RATIO)

    assert FORWARD_TESTS.WORK_TIME_CALLS == 9 and FORWARD_TESTS.WORK_TIME_RATIO == 1.0
    assert settled(0.6, 0.65) and not settled(0.95, 0.6) and not settled(0.6)
    assert not settled(0.8, 0.8, 0.8, 0.8) and settled(0.8, 0.8, 0.8, 0.8, 0.8)
    assert judged(0.8, 0.8, 0.8, 0.8, 0.8) == []
    assert settled(1.2, 0.8, 1.2, 1.2, 1.2, 1.2) and judged(1.2, 0.8, 1.2, 1.2, 1.2, 1.2)
    assert not settled(0.8, 1.1, 0.8, 1.1, 0.8, 1.1, 0.8, 1.1)
    assert judged(0.8, 1.1, 0.8, 1.1, 0.8, 1.1, 0.8, 1.1, 1.1)[0].startswith("work rule broken")
    causal, full = work_pairs(0.6)
    causal[0].problem = "its processes have ended"
    assert FORWARD_TESTS.work_rule_settled("f(q, k, v)", causal, full)


def test_saved_for_backward_names_what_is_kept():
    q, k, v = random_qkv(1, 2, 12, 12, 16, requires_grad=True)
    _, lse = FORWARD_REF["flash_attention_forward"](q.detach(), k.detach(), v.detach(), True)
    out = BACKWARD_REF["FlashAttention"].apply(q, k, v, True)
    assert measure.saved_for_backward(out, {"q": q, "k": k, "v": v, "out": out, "lse": lse}) == "q, k, v, out, lse"
    assert measure.saved_for_backward(out, {"q": q, "out": out}) == (
        "q, out, a tensor of shape (1, 2, 12, 16), a tensor of shape (1, 2, 12, 16), a tensor of shape (1, 2, 12)")


def test_triton_launches_are_counted():
    submission = Submission(TRITON_REF)
    q, k, v = random_qkv(1, 1, 8, 8, 16, dtype=torch.float32)
    with measure.TritonLaunches() as launches:
        submission.flash_attention_triton(q, k, v)
        submission.flash_attention_triton(q, k, v, causal=True)
    assert launches.count == 2
    with measure.TritonLaunches() as launches:
        FORWARD_REF["flash_attention_forward"](q, k, v)
    assert launches.count == 0


def test_a_launch_records_the_values_it_stored_in_any_layout():
    q, k, v = random_qkv(1, 1, 8, 8, 16, dtype=torch.float32)
    with measure.TritonLaunches() as launches:
        out, lse = Submission(TRITON_REF).flash_attention_triton(q, k, v)
    assert launches.wrote(out) and launches.wrote(lse)
    assert launches.wrote(out.transpose(-2, -1).contiguous())
    assert not launches.wrote(out + 1)


def test_a_launch_records_what_it_stored_in_a_buffer_larger_than_the_result():
    """A slice, a view or a copy of part of what a launch stored holds its values; values it did not
    store, or a value stored once taken twice, do not."""
    q, k, v = random_qkv(1, 2, 45, 70, 16, dtype=torch.float32)
    with measure.TritonLaunches() as launches:
        out, lse = run_cells(learner_notebook("flash_triton", LSE_IN_128_ROW_BLOCKS))["flash_attention_triton"](q, k, v)
    stored = next(tensor for tensor in launches.written if tensor.shape == (2, 128))
    assert lse.shape == (1, 2, 45) and launches.wrote(lse) and launches.wrote(lse[:, 1, 3:9].contiguous())
    assert launches.wrote(out[..., :5, :].clone()) and launches.wrote(stored)
    assert not launches.wrote(lse + 1)
    assert not launches.wrote(torch.cat([lse.flatten(), lse.flatten()[:1]]))  # one stored value, twice
    zeros, nans = torch.zeros(3), torch.full((2,), float("nan"))
    with measure.TritonLaunches() as launches:
        launches.written.append(torch.tensor([-0.0, 0.0, 1.0, float("nan"), 0.0]))
    assert launches.wrote(zeros) and launches.wrote(nans[:1]) and not launches.wrote(nans)


def test_a_triton_launch_that_raises_is_not_counted():
    """A launch made only to be counted, its error caught, computed nothing."""
    with measure.TritonLaunches() as launches:
        with pytest.raises(Exception):
            TRITON_REF["flash_attention_kernel"][(1,)]()
    assert launches.count == 0



def test_reference_float16_keeps_float32_state_and_a_float32_lse():
    """float16 inputs: out in float16 within float16's rounding of float64 attention, lse in float32 within
    float32's; the backward, given that lse, gives float16 gradients within float16's rounding of autograd's."""
    q, k, v = (t.half() for t in random_qkv(2, 2, 70, 90, 32))
    for causal in (False, True):
        out, lse = FORWARD_REF["flash_attention_forward"](q, k, v, causal, 16, 32)
        expected_out, expected_lse = pytorch_attention(q.double(), k.double(), v.double(), causal)
        assert (out.dtype, lse.dtype) == (torch.float16, torch.float32)
        torch.testing.assert_close(out.double(), expected_out, rtol=0, atol=2e-3)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=1e-5 * expected_lse.abs().max().item())
        leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
        dout = torch.randn_like(out)
        expected = torch.autograd.grad((pytorch_attention(*leaves, causal)[0] * dout.double()).sum(), leaves)
        grads = BACKWARD_REF["flash_attention_backward"](q, k, v, out, lse, dout, causal, 16, 32)
        for got, want in zip(grads, expected):
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-3 * max(1.0, want.abs().max().item()))
    x = (20 * torch.randn(3, 37, dtype=torch.float64)).half()
    softmax = FORWARD_REF["online_softmax"](x, 8)
    assert softmax.dtype == torch.float16
    torch.testing.assert_close(softmax.double(), torch.softmax(x.double(), dim=-1), rtol=0, atol=1e-3)


def test_reductions_measures_the_widest_reduction():
    x = torch.randn(3, 5, 37)
    measured = {}
    for name, compute in {"blocks of 8": lambda: FORWARD_REF["online_softmax"](x, 8),
                          "plain softmax": lambda: torch.exp(x - x.amax(dim=-1, keepdim=True)).sum(dim=-1),
                          "sum as a product": lambda: torch.exp(x) @ torch.ones(37),
                          "the largest of all": lambda: x.max(),
                          "top-1 along the row": lambda: x.topk(1).values,
                          "a bool mask": lambda: (x > 0).any(dim=-1)}.items():
        with measure.Reductions() as reductions:
            compute()
        measured[name] = reductions.widest
    assert measured == {"blocks of 8": 8, "plain softmax": 37, "sum as a product": 37, "the largest of all": 555,
                        "top-1 along the row": 37, "a bool mask": 0}


def block_sizes(inputs) -> tuple[int, int]:
    return inputs.get("block_q", FORWARD_TESTS.DEFAULT_BLOCK), inputs.get("block_k", FORWARD_TESTS.DEFAULT_BLOCK)


def assert_drawn_as_named(inputs, lengths: str, edges: str, causal: str, blocks: str) -> None:
    L, S = inputs["q"].shape[-2], inputs["k"].shape[-2]
    block_q, block_k = block_sizes(inputs)
    assert {"L < S": L < S, "L = S": L == S, "L > S": L > S}[lengths]
    assert (L % block_q and S % block_k) if edges == RAGGED else (L % block_q == S % block_k == 0)
    assert inputs["causal"] == (causal == "causal")
    assert ("block_q" in inputs.values) == ("block_k" in inputs.values) == (blocks == "given blocks")
    # At least 16 rows of each head see three key blocks or more, whatever the mask.
    assert L >= FORWARD_TESTS.FEWEST_ROWS and S >= 2 * block_k + FORWARD_TESTS.FEWEST_ROWS


@pytest.mark.timeout(600)
def test_the_hidden_inputs_are_what_their_case_names_say():
    for seed in (0, 1, 2):
        sent = sent_inputs("flash_forward", seed)
        for case, (*axes, dtype) in FORWARD_RANDOM.items():
            (inputs,) = sent[f"forward-random[{case}]"]
            assert inputs["q"].dtype == FLOAT_DTYPES[dtype]
            assert_drawn_as_named(inputs, *axes)
        for case, (lengths, causal) in FLOAT16_RANDOM.items():
            (inputs,) = sent[f"forward-float16-random[{case}]"]
            assert inputs["q"].dtype == torch.float16
            assert_drawn_as_named(inputs, lengths, RAGGED, causal, "given blocks")
        for width in FORWARD_TESTS.WIDTHS:
            for inputs in sent[f"online-softmax-random[{width}]"]:
                columns, (size,) = inputs["x"].shape[-1], inputs["block_sizes"]
                assert {"width a multiple of the block": columns % size == 0 and columns > size,
                        "ragged last block": columns % size != 0 and columns > size,
                        "one block as wide as the row or wider": size >= columns}[width]
        sent = sent_inputs("flash_backward", seed)
        for case, (*axes, dtype) in BACKWARD_RANDOM.items():
            (inputs,) = sent[f"backward-random[{case}]"]
            assert inputs["lse"].dtype == inputs["q"].dtype == FLOAT_DTYPES[dtype]
            assert_drawn_as_named(inputs, *axes)
        for case, (lengths, causal) in FLOAT16_RANDOM.items():
            (inputs,) = sent[f"backward-float16-random[{case}]"]
            assert (inputs["q"].dtype, inputs["lse"].dtype) == (torch.float16, torch.float32)
            assert_drawn_as_named(inputs, lengths, RAGGED, causal, "given blocks")
        for case, (*axes, dtype) in APPLY_RANDOM.items():
            (inputs,) = sent[f"flash-attention-apply-random[{case}]"]
            assert inputs["q"].dtype == FLOAT_DTYPES[dtype]
            assert_drawn_as_named(inputs, *axes, "default blocks")
    sent = sent_inputs("flash_triton", 0)
    for case, (lengths, edges, causal) in TRITON_RANDOM.items():
        (inputs,) = sent[f"triton-random[{case}]"]
        L, S = inputs["q"].shape[-2], inputs["k"].shape[-2]
        assert {"L < S": L < S, "L = S": L == S, "L > S": L > S}[lengths] and max(L, S) <= TRITON_TESTS.MAX_LENGTH
        assert (L % 16 and S % 16) if edges == RAGGED else (L % 64 == S % 64 == 0)
        assert inputs["causal"] == (causal == "causal")
