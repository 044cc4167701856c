"""Every copy of a reference kernel computes the same attention.

The course writes its FlashAttention kernels more than once, each for a reader of its own: the
chapters teach them (`book/`), the solutions grade with them (`solutions/flash/`), and the
benchmarks time them with what speed needs (`benchmarks/`: one reused score buffer on the CPU,
64-bit offsets and an autotuner on a GPU). This test runs every copy on the same inputs, ragged
lengths with L < S, L = S and L > S, causal or not, against one oracle written here in float64,
so that a copy that drifts fails here rather than in a reader's hands.

A chapter's copy is what its cells tagged `graded-answer` define (the definitions only, with the
chapter's imports); a solution's is what its notebook defines when run as the grader's worker
runs it.
"""

from __future__ import annotations

import ast
import importlib
import linecache
import math
import sys
from collections.abc import Callable
from functools import cache

import pytest
import torch

import autograde  # noqa: F401  (chooses Triton's interpreter where there is no CUDA GPU, before Triton loads)
from benchmarks import flash_cpu, flash_gpu
from tests.fixtures.notebooks import ROOT, learner_notebook, run_cells

sys.path.insert(0, str(ROOT / "tools"))
from course_library import python_sources, top_level  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# The book runs its chapters in book/, where they import the course's library (attention_lib).
sys.path.insert(0, str(ROOT / "book"))

# (L, S, causal): ragged against every block size used below, and a query row that sees no key.
CASES = [(37, 53, False), (37, 53, True), (64, 64, True), (53, 37, True), (70, 9, False)]
GRADED_ANSWER = "graded-answer"  # the tag of a chapter's cells that answer an exercise (tools/class_edition.py)
OUT_TOLERANCE = LSE_TOLERANCE = 2e-5  # float32 inputs, float32 running state, against float64
GRADIENT_TOLERANCE = 1e-4


@cache
def chapter(name: str) -> dict:
    """The imports of chapter `name`'s first code cell and the top-level definitions of its cells
    tagged graded-answer, run as one module (registered with linecache: Triton reads kernels' source)."""
    parts = []
    for index, (source, tags) in enumerate(python_sources(ROOT / "book" / f"{name}.md")):
        wanted = (ast.Import, ast.ImportFrom) if index == 0 else ()
        if GRADED_ANSWER in tags:
            wanted += (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)
        parts += [text for _, text in top_level(source, wanted)]
    source = "\n\n\n".join(parts) + "\n"
    filename = f"<chapter {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": f"chapter_{name.replace('-', '_')}"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


@cache
def solution(exercise_id: str) -> dict:
    return run_cells(learner_notebook(exercise_id))


FORWARDS: dict[str, Callable[[], Callable]] = {
    "book/attention_lib.py (naive_attention)": lambda: importlib.import_module("attention_lib").naive_attention,
    "book/tiled-forward.md": lambda: chapter("tiled-forward")["flash_attention_forward"],
    "book/flash-backward.md": lambda: chapter("flash-backward")["flash_attention_forward"],
    "book/triton-kernel.md": lambda: chapter("triton-kernel")["flash_attention_triton"],
    "solutions/flash/flash_forward.ipynb": lambda: solution("flash_forward")["flash_attention_forward"],
    "solutions/flash/flash_backward.ipynb": lambda: solution("flash_backward")["flash_attention_forward"],
    "solutions/flash/flash_triton.ipynb": lambda: solution("flash_triton")["flash_attention_triton"],
    "benchmarks/flash_cpu.py": lambda: flash_cpu.tiled_attention_forward,
    "benchmarks/flash_gpu.py": lambda: lambda q, k, v, causal: flash_gpu.flash_attention_triton(
        q, k, v, causal, blocks=(32, 32)),
}
BACKWARDS: dict[str, Callable[[], Callable]] = {
    "book/flash-backward.md": lambda: chapter("flash-backward")["flash_attention_backward"],
    "solutions/flash/flash_backward.ipynb": lambda: solution("flash_backward")["flash_attention_backward"],
}


def oracle(q, k, v, causal):
    """Attention in float64 from its definition: out and logsumexp; a row that sees no key gets 0 and -inf."""
    L, S = q.shape[-2], k.shape[-2]
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:  # bottom-right aligned: query i sees key j iff j <= i + S - L
        seen = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
        scores = scores.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    return weights @ v.double(), lse


def inputs(L: int, S: int, seed: int = 0, d: int = 16):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, d, generator=generator) for n in (L, S, S))


@pytest.mark.parametrize("L, S, causal", CASES, ids=[f"L={L}, S={S}, causal={c}" for L, S, c in CASES])
@pytest.mark.parametrize("copy", FORWARDS)
def test_every_forward_copy_computes_attention(copy, L, S, causal):
    q, k, v = inputs(L, S)
    out, lse = FORWARDS[copy]()(q, k, v, causal=causal)
    expected_out, expected_lse = oracle(q, k, v, causal)
    assert out.shape == expected_out.shape and lse.shape == expected_lse.shape
    assert out.dtype == lse.dtype == torch.float32
    finite = torch.isfinite(expected_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{copy}: rows with logsumexp -inf differ"
    assert torch.equal(lse[~finite], expected_lse[~finite].float())
    out_error = (out.double() - expected_out).abs().max().item()
    lse_error = (lse[finite].double() - expected_lse[finite]).abs().max().item()
    assert out_error <= OUT_TOLERANCE, f"{copy}: out off by {out_error:.1e}"
    assert lse_error <= LSE_TOLERANCE, f"{copy}: logsumexp off by {lse_error:.1e}"


@pytest.mark.parametrize("L, S, causal", CASES, ids=[f"L={L}, S={S}, causal={c}" for L, S, c in CASES])
@pytest.mark.parametrize("copy", BACKWARDS)
def test_every_backward_copy_computes_the_gradients(copy, L, S, causal):
    q, k, v = inputs(L, S, seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    expected_out, expected_lse = oracle(*leaves, causal)
    expected = torch.autograd.grad((expected_out * dout.double()).sum(), leaves)
    grads = BACKWARDS[copy]()(q, k, v, expected_out.float().detach(), expected_lse.float().detach(), dout,
                              causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert got.shape == want.shape and got.dtype == torch.float32, f"{copy}: {name} {got.shape} {got.dtype}"
        assert torch.isfinite(got).all(), f"{copy}: {name} has NaN or inf"
        error = (got.double() - want).abs().max().item()
        assert error <= GRADIENT_TOLERANCE, f"{copy}: {name} off by {error:.1e}"


def test_every_copy_of_the_course_is_checked_here():
    """A chapter or benchmark that defines a flash kernel is one of the copies above."""
    defined = set()
    for path in [*(ROOT / "book").glob("*.md"), *(ROOT / "benchmarks").glob("*.py")]:
        text = path.read_text()
        if "def flash_attention_forward(" in text or "def flash_attention_triton(" in text \
                or "def tiled_attention_forward(" in text:
            defined.add(str(path.relative_to(ROOT)))
    assert defined <= set(FORWARDS), sorted(defined - set(FORWARDS))
