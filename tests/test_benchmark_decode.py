"""The decode benchmark runs, prints its machine and its name=value lines, and computes what it times correctly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.notebooks import ROOT


@pytest.mark.timeout(300)
def test_the_decode_benchmark_reports_ratios_of_variants_that_agree():
    run = subprocess.run([sys.executable, "-m", "benchmarks.decode_variants", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("machine: ")
    values = dict(line.split("=", 1) for line in run.stdout.splitlines() if "=" in line and " " not in line)
    # (latent 512 + rotary key 64) x 2 bytes against 2 x 32 heads x 128 x 2 bytes: 1152 against 16384.
    assert int(values["cache_bytes_per_token_mla"]) == 1152 and int(values["cache_bytes_per_token_mha"]) == 16384
    for check in ("mla_absorbed_vs_explicit", "paged_vs_contiguous", "split_vs_whole"):
        assert float(values[f"max_abs_difference_{check}"]) < 1e-4, check
    assert float(values["mla_absorbed_speedup_over_explicit_at_512"]) > 0
