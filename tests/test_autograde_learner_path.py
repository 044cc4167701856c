"""The learner's path: a released notebook run in a Jupyter kernel, cell by cell, as a learner runs it."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.fixtures.notebooks import ROOT, answer, grade_id, learner_notebook

pytestmark = pytest.mark.timeout(300)

SDPA = "scaled_dot_product_attention"


def text_of(cell) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.output_type == "stream")


def cell_with(notebook, cell_id: str):
    return next(cell for cell in notebook.cells if grade_id(cell) == cell_id)


class Kernel:
    """One kernel for a notebook, in the notebook's folder; cells run one at a time, like a learner's clicks."""

    def __init__(self, notebook: nbformat.NotebookNode, folder: Path):
        self.notebook = notebook
        self.client = NotebookClient(notebook, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})

    def run(self, cell) -> str:
        if cell not in self.notebook.cells:
            self.notebook.cells.append(cell)
        self.client.execute_cell(cell, self.notebook.cells.index(cell))
        return text_of(cell)


@pytest.fixture
def kernel(tmp_path: Path):
    """The released sdpa notebook with the reference answers, in a kernel of its own."""
    notebook = learner_notebook("sdpa")
    folder = ROOT / "exercises" / "attention"  # where a learner opens it: the set-up cell finds the course
    kernel = Kernel(notebook, folder)
    with kernel.client.setup_kernel():
        yield kernel


def test_a_learners_run_says_nothing_of_seeds_and_ends_with_the_graders_verdict(kernel):
    notebook = kernel.notebook
    for cell in notebook.cells:
        if cell.cell_type == "code" and not grade_id(cell).startswith("check-sdpa"):
            kernel.run(cell)
    scratch = nbformat.v4.new_code_cell(  # a careful learner compares with the library
        "import torch.nn.functional as F\nq, k, v = torch.randn(1, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 2)\n"
        "print(torch.allclose(scaled_dot_product_attention(q, k, v)[0], F.scaled_dot_product_attention(q, k, v)))")
    assert kernel.run(scratch).strip() == "True"
    out = kernel.run(cell_with(notebook, "check-sdpa"))
    lines = out.strip().splitlines()
    assert lines[-1].startswith('check("sdpa"): 6 of 6 points from the visible tests'), out
    assert "not counted" in out and "NOT ALLOWED" not in out  # the comparison is a note, not a zero
    assert "seed" not in out.lower()
    first_test = cell_with(notebook, "test-no-mask")
    assert kernel.run(first_test).strip() == "test no-mask passed"


def test_a_deleted_cell_no_longer_counts(kernel):
    notebook = kernel.notebook
    kernel.run(cell_with(notebook, "setup"))
    cheat = nbformat.v4.new_code_cell(
        "import torch.nn.functional as F\n\ndef scaled_dot_product_attention(q, k, v, mask=None):\n"
        "    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None\n")
    kernel.run(cheat)
    kernel.run(cell_with(notebook, "causal_mask"))
    check = nbformat.v4.new_code_cell('from autograde import check\ncheck("sdpa")')
    assert "NOT ALLOWED: uses torch.nn.functional.scaled_dot_product_attention" in kernel.run(copy.deepcopy(check))
    notebook.cells.remove(cheat)  # the learner deletes the cell and writes their own
    kernel.run(nbformat.v4.new_code_cell(answer("sdpa", SDPA)))
    out = kernel.run(copy.deepcopy(check))
    assert "NOT ALLOWED" not in out and out.strip().splitlines()[-1].startswith('check("sdpa"): 6 of 6 points')


def test_the_set_up_cell_says_what_to_do_when_the_course_is_not_found(tmp_path: Path):
    notebook = nbformat.read(ROOT / "exercises" / "attention" / "sdpa.ipynb", as_version=4)
    lonely = tmp_path / "somewhere"
    lonely.mkdir()
    shutil.copy(ROOT / "exercises" / "attention" / "sdpa.ipynb", lonely / "sdpa.ipynb")
    kernel = Kernel(notebook, lonely)
    with kernel.client.setup_kernel():
        kernel.run(nbformat.v4.new_code_cell(  # as where the course is not installed
            "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' in p or 'lib/python' in p]\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', ''))]"))
        out = kernel.run(cell_with(notebook, "setup"))
    assert "autograde" in out and "clone" in out and "AUTOGRADE_COURSE" not in out
