"""A learner's kernel (Colab's, say) has the course's core dependencies, not the grader's.

`import autograde`, `check()` and nbgrader's test cells must work there without nbgrader,
tqdm, markdown-it or matplotlib, which only the instructor's grader needs.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.fixtures.notebooks import ROOT

GRADER_ONLY = ("nbgrader", "tqdm", "markdown_it", "matplotlib", "tornado")

RUN_WITHOUT_THEM = """
import importlib.abc, json, sys

class GraderOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")

sys.meta_path.insert(0, GraderOnly())
namespace = {{"__name__": "__main__"}}
for cell in json.load(open({notebook!r}))["cells"]:
    if cell["cell_type"] == "code":
        exec("".join(cell["source"]), namespace)
"""


def test_a_solution_notebook_runs_its_checks_and_test_cells_without_the_graders_packages():
    notebook = ROOT / "solutions" / "attention" / "sdpa.ipynb"
    cells = [cell for cell in json.loads(notebook.read_text())["cells"] if cell["cell_type"] == "code"]
    test_cells = sum("frontends.nbgrader import run" in "".join(cell["source"]) for cell in cells)
    script = RUN_WITHOUT_THEM.format(blocked=set(GRADER_ONLY), notebook=str(notebook))
    result = subprocess.run([sys.executable, "-c", script], cwd=notebook.parent, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    passed = [line for line in result.stdout.splitlines() if line.startswith("test ") and line.endswith(" passed")]
    assert test_cells > 0 and len(passed) == test_cells, result.stdout[-3000:]
