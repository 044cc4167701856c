"""Time a cold build of the book and a rebuild with nothing changed.

    python -m benchmarks.book_build [--output DIR]

A cold build executes every chapter (no execution cache, no Sphinx environment); the
rebuild that follows it in the same output folder finds everything cached. Both build as
`make book` does: the chapters executed into the cache one a core, then Jupyter Book with its
strict flags. The last lines are `name=value` pairs.
"""
import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STRICT_FLAGS = ["-W", "-n", "--keep-going"]


def build_seconds(output: Path) -> float:
    """As `make book` builds: the chapters executed into the cache one a core, then Jupyter Book."""
    cache = output / "_build" / ".jupyter_cache"
    commands = [[sys.executable, str(ROOT / "tools" / "execute_chapters.py"), str(cache)],
                [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT),
                 "--path-output", str(output), *STRICT_FLAGS]]
    start = time.perf_counter()
    for command in commands:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="build folder (default: a temporary one)")
    args = parser.parse_args()
    output = args.output or Path(tempfile.mkdtemp(prefix="book-build-"))
    shutil.rmtree(output / "_build", ignore_errors=True)

    cold = build_seconds(output)
    rebuild = build_seconds(output)
    chapters = len(list((output / "_build" / "html" / "book").glob("*.html")))

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"{'build':<22}{'seconds':>10}")
    print(f"{'cold':<22}{cold:>10.1f}")
    print(f"{'no-change rebuild':<22}{rebuild:>10.1f}")
    print(f"pages={chapters}")
    print(f"cold_build_s={cold:.1f}")
    print(f"rebuild_s={rebuild:.1f}")
    if args.output is None:
        shutil.rmtree(output, ignore_errors=True)


if __name__ == "__main__":
    main()
