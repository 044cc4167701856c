"""The book's chapters executed into its execution cache, one a core, before Jupyter Book builds it.

    python tools/execute_chapters.py _build/.jupyter_cache

Jupyter Book 1.x executes the chapters one after the other (`execute_notebooks: cache` in
`_config.yml`); jupyter-cache, which holds that cache, has an executor of its own that runs them
side by side. Each chapter is read as Jupyter Book reads it (myst-nb's reader) and executed in its
own folder with the cell time limit of `_config.yml`; the build then finds it in the cache. A
chapter that fails here is not cached, so the build executes it again and reports it as it would
have: the build stays the judge of the book.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml
from jupyter_cache import get_cache
from jupyter_cache.executors import load_executor

ROOT = Path(__file__).resolve().parents[1]
MYST_READER = {"type": "plugin", "name": "myst_nb_md"}  # how myst-nb hands a MyST chapter to jupyter-cache


def chapters(book: Path) -> list[Path]:
    """The pages with a kernel: the ones Jupyter Book executes."""
    return sorted(page for page in book.glob("*.md") if "\nkernelspec:" in page.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="the edition's execution cache, as Jupyter Book places it")
    args = parser.parse_args(argv)
    execute = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["execute"]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = get_cache(args.cache)
    for chapter in chapters(ROOT / "book"):
        cache.add_nb_to_project(str(chapter), read_data=MYST_READER)
    result = load_executor("local-parallel", cache, logger=logging.getLogger("execute_chapters")).run_and_cache(
        timeout=execute["timeout"], allow_errors=execute["allow_errors"])
    failed = result.excepted + result.errored
    if failed:
        print(f"not cached, executed again by the build: {', '.join(Path(uri).name for uri in failed)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
