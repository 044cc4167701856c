"""Smoke test of `python -m benchmarks.kv_cache --quick`: it runs, prints its table, and its
name=value lines are parseable, positive, and give the right cache sizes. Timings are not checked."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Independent of the benchmark's own constants: 32 query heads of width 128, batch 8, float32.
KV_HEADS = {"mha": 32, "gqa8": 8, "mqa": 1}
BATCH, HEAD_DIM, FLOAT32_BYTES = 8, 128, 4


pytestmark = pytest.mark.xdist_group("benchmark_kv_cache")  # one quick run of the benchmark

@pytest.fixture(scope="module")
def quick_output():
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.kv_cache", "--quick", "--threads", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


@pytest.fixture(scope="module")
def values(quick_output):
    pairs = re.findall(r"^([a-z0-9_]+)=(\S+)$", quick_output, flags=re.MULTILINE)
    assert pairs, "no name=value lines"
    return {name: float(value) for name, value in pairs}


@pytest.fixture(scope="module")
def contexts(values):
    found = sorted(int(m.group(1)) for name in values if (m := re.fullmatch(r"mha_cache_bytes_at_(\d+)", name)))
    assert found, "no mha_cache_bytes_at_<context> line"
    return found


def test_prints_machine_and_table(quick_output, contexts):
    for field in ("cpu:", "cores:", "torch:", "threads:"):
        assert field in quick_output
    header = next(line for line in quick_output.splitlines() if line.strip().startswith("context"))
    for column in ("MHA ms", "GQA-8 ms", "MQA ms"):
        assert column in header
    rows = [line.split("|") for line in quick_output.splitlines() if re.match(r"^\s*\d+\s*\|", line)]
    assert [int(row[0]) for row in rows] == contexts
    assert all(len(row) == len(header.split("|")) for row in rows)


def test_values_are_positive(values):
    assert all(value > 0 for value in values.values())


def test_expected_names(values, contexts):
    for context in contexts:
        for name in KV_HEADS:
            assert f"{name}_ms_at_{context}" in values
        for name in ("gqa8", "mqa"):
            assert f"{name}_speedup_vs_mha_at_{context}" in values


def test_cache_bytes(values, contexts):
    for context in contexts:
        for name, kv_heads in KV_HEADS.items():
            keys_and_values = 2 * BATCH * kv_heads * context * HEAD_DIM * FLOAT32_BYTES
            assert values[f"{name}_cache_bytes_at_{context}"] == keys_and_values


def test_speedups_are_time_ratios(values, contexts):
    for context in contexts:
        for name in ("gqa8", "mqa"):
            ratio = values[f"mha_ms_at_{context}"] / values[f"{name}_ms_at_{context}"]
            assert values[f"{name}_speedup_vs_mha_at_{context}"] == pytest.approx(ratio, rel=1e-2)
