"""`python -m benchmarks.check_latency` drives a real Jupyter kernel: a row per exercise asked for,
the first call and those after it timed inside the kernel, every check passing."""

from __future__ import annotations

import json
import tempfile

from benchmarks import check_latency


def test_the_benchmark_times_check_in_a_real_kernel_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the kernel's sockets go
    report = tmp_path / "report.json"
    assert check_latency.main(["--exercise", "sdpa", "--calls", "1", "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["exercises"]
    assert [row["exercise"] for row in rows] == ["sdpa"] and rows[0]["failed"] == [], rows
    assert len(rows[0]["calls"]) == 2 and all(call["wall_seconds"] > 0 for call in rows[0]["calls"]), rows
    assert rows[0]["later_wall_seconds"] == rows[0]["calls"][1]["wall_seconds"]
    printed = capsys.readouterr().out
    assert "| sdpa |" in printed and "first_check_seconds_sdpa=" in printed
    assert list(scratch.iterdir()) == []
