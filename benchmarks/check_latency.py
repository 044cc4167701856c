"""`check(id)` in a learner's Jupyter kernel: the first call, imports included, and the calls after it.

    python -m benchmarks.check_latency                        # every exercise, 3 calls after the first
    python -m benchmarks.check_latency --exercise sdpa --calls 5

For each exercise, a fresh kernel (`jupyter_client`, this interpreter's `ipykernel`, over Unix
sockets in a folder of its own: TCP ports that jupyter_client picks and frees before the kernel
binds them could be taken by then, by the previous kernel's among others) runs the code
cells of the exercise's solution notebook, as a learner who solved it has run them (its checks and
nbgrader's test cells left out), then `from autograde import check; check("<id>")` once and
`--calls` times more. Each call is timed inside the kernel: wall seconds, and the kernel's CPU
seconds (`time.process_time`, all its threads), which depend much less on what else the machine
runs. The course's solutions are here, so the expected values are computed in the kernel, as in an
instructor's copy; a class's copy reads them from the released `<id>.expected.zip` instead. Every
test a call runs must pass; otherwise the command exits 1. It prints the machine, a table and
name=value lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import nbformat

from autograde import registry
from benchmarks.grading_throughput import machine_description

ROOT = Path(__file__).resolve().parents[1]
TIMING = "check-timing:"
CELL_SECONDS = 600


def learner_cells(exercise: registry.Exercise) -> list[str]:
    """The solution notebook's code cells a learner runs before checking: not the checks, not the tests."""
    notebook = nbformat.read(ROOT / "solutions" / exercise.notebook, as_version=4)
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"
            and not cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "").startswith("test-")
            and not any(line.lstrip().startswith("check(") for line in cell.source.splitlines())]


def timed_check(exercise_id: str) -> str:
    return (f"import time as _time\n_cpu, _wall = _time.process_time(), _time.perf_counter()\n"
            f"from autograde import check\ncheck({exercise_id!r})\n"
            f"print({TIMING!r}, _time.perf_counter() - _wall, _time.process_time() - _cpu)")


def run_cell(client, source: str) -> str:
    """Run `source` in the kernel; its printed output. Raises if the cell raised."""
    output: list[str] = []

    def hook(message):
        content = message["content"]
        if message["msg_type"] == "stream":
            output.append(content["text"])
        elif message["msg_type"] == "error":
            output.append("\n".join(content["traceback"]))

    reply = client.execute_interactive(source, timeout=CELL_SECONDS, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the cell failed:\n{source}\n{''.join(output)[-3000:]}")
    return "".join(output)


def measure(exercise: registry.Exercise, calls: int) -> dict:
    """A fresh kernel: the learner's cells, then 1 + `calls` checks, each timed."""
    from jupyter_client.manager import KernelManager

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    sockets = tempfile.TemporaryDirectory(prefix="check-latency-")
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets.name, "kernel"))
    manager.start_kernel(cwd=str(ROOT / "solutions" / exercise.assignment), env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=CELL_SECONDS)
        for source in learner_cells(exercise):
            run_cell(client, source)
        timings, failed = [], []
        for _ in range(1 + calls):
            output = run_cell(client, timed_check(exercise.id))
            line = next(line for line in output.splitlines() if line.startswith(TIMING))
            wall, cpu = map(float, line.removeprefix(TIMING).split())
            timings.append({"wall_seconds": wall, "cpu_seconds": cpu})
            failed += [line for line in output.splitlines() if line.lstrip().startswith("FAIL")]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        sockets.cleanup()
    later = timings[1:]
    return {"exercise": exercise.id, "first": timings[0],
            "later_wall_seconds": statistics.median(t["wall_seconds"] for t in later) if later else None,
            "later_cpu_seconds": statistics.median(t["cpu_seconds"] for t in later) if later else None,
            "calls": timings, "failed": failed}


def markdown(machine: dict, rows: list[dict]) -> str:
    lines = [f"- {key}: {value}" for key, value in machine.items()]
    lines += ["", "| exercise | first check(): wall s | CPU s | later (median): wall s | CPU s |",
              "|---|---:|---:|---:|---:|"]
    for row in rows:
        later = (f"{row['later_wall_seconds']:.2f} | {row['later_cpu_seconds']:.2f}"
                 if row["later_wall_seconds"] is not None else "- | -")
        lines.append(f"| {row['exercise']} | {row['first']['wall_seconds']:.2f} | {row['first']['cpu_seconds']:.2f} "
                     f"| {later} |")
    lines += [f"{row['exercise']}: FAILED {line}" for row in rows for line in row["failed"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exercise", action="append", choices=list(registry.EXERCISES),
                        help="an exercise (repeatable; default: every one)")
    parser.add_argument("--calls", type=int, default=3, help="calls timed after the first (default 3)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    machine = machine_description()
    rows = [measure(registry.EXERCISES[name], args.calls) for name in (args.exercise or registry.EXERCISES)]
    print(markdown(machine, rows))
    print()
    for row in rows:
        print(f"first_check_seconds_{row['exercise']}={row['first']['wall_seconds']:.3g}")
        print(f"first_check_cpu_seconds_{row['exercise']}={row['first']['cpu_seconds']:.3g}")
        if row["later_wall_seconds"] is not None:
            print(f"later_check_seconds_{row['exercise']}={row['later_wall_seconds']:.3g}")
            print(f"later_check_cpu_seconds_{row['exercise']}={row['later_cpu_seconds']:.3g}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "exercises": rows}, indent=2) + "\n")
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
