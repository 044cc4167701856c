"""The FlashAttention benchmarks run and report what they promise; no timing is asserted.

- `benchmarks.flash_cpu --quick` prints its machine, a table with a row per (N, causal),
  and ends with `name=value` lines whose values are positive numbers;
- its tiled forward agrees with naive attention (an independent oracle written here);
- `benchmarks.flash_gpu` exits cleanly with its message when there is no CUDA GPU, and its
  kernel passes its check in Triton's interpreter.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.flash_cpu import QUICK_LENGTHS, tiled_attention_forward

REPO = Path(__file__).resolve().parents[1]
NAME_VALUE = re.compile(r"^([a-z][a-z0-9_]*)=(\S+)$")


def run_module(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**os.environ, **(env or {})},
    )


def trailing_name_values(stdout):
    """The `name=value` lines at the end of the output, as a dict; they must come last."""
    lines = stdout.strip().splitlines()
    pairs = {}
    for line in reversed(lines):
        match = NAME_VALUE.match(line.strip())
        if not match:
            break
        pairs[match.group(1)] = match.group(2)
    return pairs


def naive_attention(q, k, v, causal):
    """Full score matrix, bottom-right causal mask; rows with no allowed key give 0 / -inf."""
    L, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v, lse


pytestmark = pytest.mark.xdist_group("benchmark_flash")  # one quick run of the benchmark

@pytest.fixture(scope="module")
def quick_run():
    return run_module("benchmarks.flash_cpu", "--quick")


def test_flash_cpu_quick_runs_and_prints_its_machine(quick_run):
    assert quick_run.returncode == 0, quick_run.stderr
    assert quick_run.stdout.startswith("machine: ")


def test_flash_cpu_quick_prints_a_row_per_length_and_mask(quick_run):
    lines = quick_run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "time x" in line and "mem x" in line)
    rows = {(fields[0], fields[1]) for fields in (line.split() for line in lines[header + 1:])
            if len(fields) == 10}
    assert rows == {(str(n), c) for n in QUICK_LENGTHS for c in ("False", "True")}


def test_flash_cpu_quick_ends_with_positive_name_values(quick_run):
    pairs = trailing_name_values(quick_run.stdout)
    expected = {f"{metric}_n{n}_{mask}" for metric in ("time_ratio", "memory_ratio",
                                                        "tiled_peak_over_qkvo")
                for n in QUICK_LENGTHS for mask in ("full", "causal")}
    expected |= {f"causal_time_ratio_n{n}" for n in QUICK_LENGTHS}
    assert set(pairs) == expected
    for name, value in pairs.items():
        assert math.isfinite(float(value)) and float(value) > 0, name


@pytest.mark.parametrize("L, S, causal", [
    (300, 300, False), (300, 300, True), (200, 600, True), (600, 200, True), (33, 47, False),
])
def test_flash_cpu_tiled_forward_matches_naive_attention(L, S, causal):
    torch.manual_seed(L + S)
    q = torch.randn(2, 3, L, 32, dtype=torch.float64)
    k, v = torch.randn(2, 3, S, 32, dtype=torch.float64), torch.randn(2, 3, S, 32, dtype=torch.float64)
    out, lse = tiled_attention_forward(q, k, v, causal, block_q=64, block_k=128)
    ref_out, ref_lse = naive_attention(q, k, v, causal)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
    # Rows that may attend nothing (L > S, causal) have logsumexp -inf in both.
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_flash_gpu_exits_cleanly_without_a_gpu():
    result = run_module("benchmarks.flash_gpu")
    assert result.returncode == 0
    assert "no CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is for CPU-only machines")
def test_flash_gpu_kernel_passes_the_interpreter_check():
    result = run_module("benchmarks.flash_gpu", "--interpret-check")
    assert result.returncode == 0, result.stderr
    pairs = trailing_name_values(result.stdout)
    assert float(pairs["interpret_max_error"]) < 1e-4
