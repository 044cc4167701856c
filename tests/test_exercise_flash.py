"""The flash exercises: the references agree with PyTorch, the grader gives the solutions full marks
and the release 0, and wrong answers lose exactly the tests they break, rules included.

The rules (memory, work, saved tensors, Triton launch) are graded by measuring the learner's
call, so the wrong answers here include ones with the right values and the wrong method.
Answers run in this process, as in `test_exercises_wrong`; their cells are registered with
`linecache` as in the worker, because Triton reads a kernel's source when it decorates it.
One command-line run grades a small class through the sandboxed worker.
"""

from __future__ import annotations

import csv
import linecache
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autograde import registry as exercises
from autograde import rules
from autograde.frontends import check as self_check
from autograde.grading import grade, reference
from autograde.grading.session import catalogue
from autograde.sandbox.observe import Submission
from autograde.submission import extract
from tests.fixtures.implementations import Variant, variant_id
from tests.fixtures.notebooks import ROOT, SEED, answer, failed, learner_notebook, lost, write

pytestmark = pytest.mark.timeout(120)

# The tests of values; the rules are tests of their own, which wrong values do not fail.
FORWARD_CASES = {"forward-ragged", "forward-causal", "forward-causal-more-queries", "forward-default-blocks"}
FORWARD_HIDDEN = {"forward-random", "forward-random-more-queries"}
BACKWARD_CASES = {"backward-ragged", "backward-causal", "backward-causal-more-queries"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The grader's worker runs one thread: the blocks are many small operations, for which a
    second thread on a shared machine mostly waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replaced(source: str, old: str, new: str) -> str:
    """`source` with `old` replaced, which must be there: a variant never silently equals the reference."""
    assert old in source, old
    return source.replace(old, new)




FORWARD = answer("flash_forward", "flash_attention_forward")
FORWARD_AGAIN = answer("flash_backward", "flash_attention_forward")
BACKWARD = answer("flash_backward", "flash_attention_backward")
FUNCTION = answer("flash_backward", "FlashAttention")
KERNEL = answer("flash_triton", "flash_attention_kernel")

FULL_MATRIX_FORWARD = """
def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):
    L, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        visible = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
        scores = scores.masked_fill(~visible, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    shift = torch.where(row_max == -math.inf, 0.0, row_max)
    exps = torch.exp(scores - shift)
    total = exps.sum(dim=-1, keepdim=True)
    return (exps @ v) / torch.where(total > 0, total, 1.0), (shift + torch.log(total)).squeeze(-1)
"""

FULL_MATRIX_BACKWARD = """
def flash_attention_backward(q, k, v, out, lse, dout, causal=False, block_q=64, block_k=64):
    L, S = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        visible = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
        scores = scores.masked_fill(~visible, -math.inf)
    p = torch.exp(scores - torch.where(lse == -math.inf, math.inf, lse)[..., None])
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(dim=-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout
"""

TORCH_INSTEAD_OF_TRITON = FULL_MATRIX_FORWARD.replace(
    "def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):",
    "def flash_attention_triton(q, k, v, causal=False):")

WRONG = [
    Variant("no-accumulator-rescale", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, "acc = acc * rescale + p @ v", "acc = acc + p @ v")},
        frozenset(FORWARD_CASES), hidden_may_fail=frozenset(FORWARD_HIDDEN), message="`out`: max abs error"),
    Variant("lse-without-the-scale", "flash_forward", {"flash_attention_forward": replaced(replaced(replaced(
        FORWARD, "q_block = q[:, :, q_start:q_end] * scale", "q_block = q[:, :, q_start:q_end]"),
        "p = torch.exp(scores - shift)", "p = torch.exp((scores - shift) * scale)"),
        "rescale = torch.exp(row_max - shift)", "rescale = torch.exp((row_max - shift) * scale)")},
        frozenset(FORWARD_CASES), frozenset(FORWARD_HIDDEN), message="`lse`: max abs error"),
    Variant("full-score-matrix", "flash_forward", {"flash_attention_forward": FULL_MATRIX_FORWARD},
        frozenset({"memory-rule", "work-rule"}),
        message="memory rule broken: the largest tensor created by flash_attention_forward holds 122,880 "
                "elements, 10x the 12,288 allowed"),
    Variant("masks-instead-of-skipping", "flash_forward", {"flash_attention_forward": replaced(
        FORWARD, "k_stop = min(S, q_end + diagonal) if causal else S", "k_stop = S")},
        frozenset({"work-rule"}),
        message="work rule broken: with causal=True the forward spends 67,108,864 matmul FLOPs, 1x the "
                "67,108,864 of causal=False; at most 0.6x is allowed (the reference: 0.531x)"),
    Variant("D-from-one-key-block", "flash_backward", {"flash_attention_backward": replaced(
        BACKWARD, "ds = p * (dout_block @ v_block.transpose(-2, -1) - delta[:, :, q_start:q_end])",
        "dp = dout_block @ v_block.transpose(-2, -1)\n            ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))")},
        frozenset(BACKWARD_CASES), hidden_may_fail=frozenset({"backward-random", "flash-attention-apply-random"}),
        message="`dq`: max abs error"),
    Variant("full-score-matrix-backward", "flash_backward", {"flash_attention_backward": FULL_MATRIX_BACKWARD},
        frozenset({"backward-memory-rule"}),
        message="memory rule broken: the largest tensor created by flash_attention_backward holds 122,880 "
                "elements, 10x the 12,288 allowed"),
    Variant("saves-the-probabilities", "flash_backward", {"FlashAttention": replaced(replaced(
        FUNCTION, "ctx.save_for_backward(q, k, v, out, lse)",
        "p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - lse[..., None])\n"
        "        ctx.save_for_backward(q, k, v, out, lse, p)"),
        "q, k, v, out, lse = ctx.saved_tensors", "q, k, v, out, lse, p = ctx.saved_tensors")},
        frozenset({"saved-tensors-rule"}),
        message="saved-tensors rule broken: FlashAttention's forward saves q, k, v, out, lse, a tensor of shape "
                "(1, 2, 24, 24); it must save exactly q, k, v, out, lse"),
    Variant("triton-ragged-keys-score-0", "flash_triton", {"flash_attention_kernel": replaced(
        KERNEL, """        visible = cols[None, :] < S
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
        scores = tl.where(visible, scores, float("-inf"))""", """        if CAUSAL:
            scores = tl.where(cols[None, :] <= rows[:, None] + diagonal, scores, float("-inf"))""")},
        frozenset({"triton-ragged"}), hidden_may_fail=frozenset({"triton-random"}), message="`out`: max abs error"),
    Variant("attention-in-pytorch", "flash_triton", {"flash_attention_triton": TORCH_INSTEAD_OF_TRITON},
        frozenset(c.name for c in catalogue(exercises.get("flash_triton")) if c.visible),
        frozenset(c.name for c in catalogue(exercises.get("flash_triton")) if not c.visible),
        message="Triton rule broken: flash_attention_triton launched 0 Triton kernels"),
]

RIGHT = [
    Variant("einsum-one-head-at-a-time", "flash_forward", {"flash_attention_forward": """
def flash_attention_forward(q, k, v, causal=False, block_q=64, block_k=64):
    B, H, L, d = q.shape
    S = k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((B, H, L), -math.inf, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i0 in range(0, L, block_q):
                rows = torch.arange(i0, min(i0 + block_q, L))
                m = torch.full((len(rows),), -math.inf, dtype=q.dtype)
                total = torch.zeros(len(rows), dtype=q.dtype)
                acc = torch.zeros(len(rows), d, dtype=q.dtype)
                last = min(S, rows[-1].item() + 1 + S - L) if causal else S
                for j0 in range(0, max(last, 0), block_k):
                    cols = torch.arange(j0, min(j0 + block_k, last))
                    s = torch.einsum("id,jd->ij", q[b, h, rows], k[b, h, cols]) * d ** -0.5
                    if causal:
                        s = torch.where(cols[None, :] <= rows[:, None] + (S - L), s, -math.inf)
                    m_new = torch.maximum(m, s.max(dim=1).values)
                    safe = torch.nan_to_num(m_new, neginf=0.0)
                    p = torch.exp(s - safe[:, None])
                    total = total * torch.exp(m - safe) + p.sum(dim=1)
                    acc = acc * torch.exp(m - safe)[:, None] + torch.einsum("ij,jd->id", p, v[b, h, cols])
                    m = m_new
                seen = total > 0
                out[b, h, rows] = torch.where(seen[:, None], acc / torch.where(seen, total, 1.0)[:, None], 0.0)
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


def run_cells(notebook) -> dict:
    """The notebook's code as the worker runs it: cells extracted, sources kept for `inspect`."""
    namespace = {"__name__": "__main__"}
    for cell in extract.code_cells(notebook):
        filename = f"<cell {cell.number}>"
        linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(True), filename)
        exec(compile(cell.source, filename, "exec"), namespace)
    return namespace


def grade_in_process(exercise_id: str, answers: dict[str, str]):
    exercise = exercises.get(exercise_id)
    namespace = run_cells(learner_notebook(exercise_id, answers))
    results, violations, _ = self_check.run_in_kernel(exercise, namespace, SEED)
    return {result.name: result for result in results}, violations



@pytest.mark.parametrize("variant", WRONG, ids=variant_id)
def test_a_wrong_answer_loses_exactly_the_tests_it_breaks(variant):
    results, violations = grade_in_process(variant.exercise, variant.answers)
    assert not violations
    visible, hidden = lost(results)
    assert visible == variant.visible_failures
    assert variant.hidden_failures <= hidden <= variant.hidden_failures | variant.hidden_may_fail
    first = next(results[c.name] for c in catalogue(exercises.get(variant.exercise)) if c.name in visible)
    assert any(problem.startswith(variant.message) for problem in first.problems), first.problems


@pytest.mark.parametrize("variant", RIGHT, ids=variant_id)
def test_a_right_answer_in_another_style_passes_every_test(variant):
    results, violations = grade_in_process(variant.exercise, variant.answers)
    assert not violations
    assert failed(results) == set()


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
    assert [v.name for v in violations] == ["torch.Tensor.softmax"]


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

FORWARD_REF = reference.namespace(exercises.get("flash_forward"))
BACKWARD_REF = reference.namespace(exercises.get("flash_backward"))
TRITON_REF = reference.namespace(exercises.get("flash_triton"))

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
        with rules.Footprint() as footprint:
            FORWARD_REF["flash_attention_forward"](q, k, v, causal)
        flops[causal] = footprint.matmul_flops
    assert flops[True] / flops[False] == 136 / 256  # 16 x 16 blocks of 64, the diagonal and below

    q, k, v = random_qkv(2, 2, 192, 160, 16, dtype=torch.float32)
    with rules.Footprint() as footprint:
        out, lse = FORWARD_REF["flash_attention_forward"](q, k, v, block_q=32, block_k=32)
    assert footprint.largest == q.numel()  # out and q's scaled blocks; a block of scores is 4,096
    dout = torch.randn_like(out)
    with rules.Footprint() as footprint:
        BACKWARD_REF["flash_attention_backward"](q, k, v, out, lse, dout, block_q=32, block_k=32)
    assert footprint.largest == q.numel()


def test_footprint_counts_matmul_flops_as_flopcountermode_does():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = random_qkv(2, 1, 100, 80, 16)
    forward = FORWARD_REF["flash_attention_forward"]
    with rules.Footprint() as footprint:
        forward(q, k, v, True, 32, 16)
    with FlopCounterMode(display=False) as counter:
        forward(q, k, v, True, 32, 16)
    assert footprint.matmul_flops == counter.get_total_flops() > 0


def test_saved_for_backward_names_what_is_kept():
    q, k, v = random_qkv(1, 2, 12, 12, 16, requires_grad=True)
    _, lse = FORWARD_REF["flash_attention_forward"](q.detach(), k.detach(), v.detach(), True)
    out = BACKWARD_REF["FlashAttention"].apply(q, k, v, True)
    assert rules.saved_for_backward(out, {"q": q, "k": k, "v": v, "out": out, "lse": lse}) == "q, k, v, out, lse"
    assert rules.saved_for_backward(out, {"q": q, "out": out}) == (
        "q, out, a tensor of shape (1, 2, 12, 16), a tensor of shape (1, 2, 12, 16), a tensor of shape (1, 2, 12)")


def test_triton_launches_are_counted():
    submission = Submission(TRITON_REF)
    q, k, v = random_qkv(1, 1, 8, 8, 16, dtype=torch.float32)
    with rules.TritonLaunches() as launches:
        submission.flash_attention_triton(q, k, v)
        submission.flash_attention_triton(q, k, v, causal=True)
    assert launches.count == 2
    with rules.TritonLaunches() as launches:
        FORWARD_REF["flash_attention_forward"](q, k, v)
    assert launches.count == 0

