"""Each step of the grader's pipeline on its own: load, extract, scan, wire, compare, seeds."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autograde import cases
from autograde import registry as exercises
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX
from autograde.compare import CaseResult, compare_tensor
from autograde.grading import grade
from autograde.grading.local import LocalSubmission
from autograde.grading.reference import Reference
from autograde.grading.session import catalogue, max_score
from autograde.observe import OtherValue, observe_tensor
from autograde.sandbox import isolation, wire
from autograde.sandbox.tripwire import ForbiddenCall, Tripwire, resolve
from autograde.submission import extract, forbidden, notebook
from tests.fixtures.notebooks import sent_inputs

pytestmark = pytest.mark.timeout(60)


# notebook: the grader's processes start without compiling grammars nothing uses.

def test_the_grader_reads_notebooks_without_jsonschemas_iri_grammars():
    """`python -m autograde` imports nbformat only when it reads a notebook, after marking rfc3987-syntax
    absent: jsonschema would compile 39 grammars (0.8 s of each grading process) for IRI formats."""
    code = ("import sys\nfrom pathlib import Path\nfrom autograde.frontends import cli\n"
            "assert 'nbformat' not in sys.modules, 'the command line imports nbformat'\n"
            "from autograde.submission import notebook\nnotebook.skip_iri_grammars()\n"
            "loaded = notebook.load(Path('solutions/attention/sdpa.ipynb'))\n"
            "import nbformat\nnbformat.validate(loaded)\n"
            "assert 'lark' not in sys.modules, 'grammars compiled'\nprint(len(loaded.cells))")
    ran = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) > 5


def test_a_cell_is_labelled_by_its_position_and_the_execution_count_jupyter_shows():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("text"),
                                               nbformat.v4.new_code_cell("x = 1", execution_count=7),
                                               nbformat.v4.new_code_cell("y = 2")])
    assert [cell.label for cell in extract.code_cells(notebook)] == ["cell 2 (In [7])", "cell 3"]


# notebook: a file that cannot be graded says why.

@pytest.mark.parametrize("content, reason", [
    (b"", "is empty (0 bytes)"),
    (b"print('hello')\n", "not a notebook: not valid JSON (Expecting value at line 1, column 1)"),
    (b"\xff\xfe\x00", "is not UTF-8 text"),
    (b"[1, 2]", "is JSON but not a notebook"),
    (json.dumps({"cells": [], "nbformat": 3}).encode(), "has nbformat 3; version 4 is needed"),
    (json.dumps({"cells": [{"cell_type": "code"}], "nbformat": 4}).encode(), "cell 1 has no text source"),
    (json.dumps({"cells": [{"cell_type": "widget", "source": ""}], "nbformat": 4}).encode(),
     "cell 1 is not a code, markdown or raw cell"),
])
def test_an_unreadable_notebook_gets_a_clear_reason(tmp_path: Path, content: bytes, reason: str):
    path = tmp_path / "sdpa.ipynb"
    path.write_bytes(content)
    with pytest.raises(notebook.NotebookError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        notebook.load(path)


def test_a_notebook_with_list_sources_loads(tmp_path: Path):
    path = tmp_path / "sdpa.ipynb"
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                                "cells": [{"cell_type": "code", "source": ["x = 1\n", "y = 2\n"], "metadata": {}}]}))
    assert notebook.load(path).cells[0].source == "x = 1\ny = 2\n"


# extract: the code a submission defines.

def cells_of(*sources, metadata=None) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_code_cell(source) for source in sources]
    for cell in cells:
        cell.metadata = metadata or {}
    return nbformat.v4.new_notebook(cells=cells)


def test_magics_and_shell_lines_become_pass_and_keep_line_numbers():
    [cell] = extract.code_cells(cells_of("%matplotlib inline\nx = 1\nfor i in range(2):\n    !ls\ny = 2"))
    assert cell.source == "pass\nx = 1\nfor i in range(2):\n    pass\ny = 2"


def test_a_python_cell_magic_keeps_its_body_and_another_cell_magic_is_dropped():
    cells = extract.code_cells(cells_of("%%time\nx = 1", "%%bash\necho hi", "y = 10 % 3"))
    assert [c.source for c in cells] == ["\nx = 1", "y = 10 % 3"]
    assert [c.number for c in cells] == [1, 3]


def test_the_release_check_and_test_cells_and_check_calls_are_skipped():
    release = nbformat.read(Path(__file__).parents[1] / "exercises" / "attention" / "sdpa.ipynb", as_version=4)
    kept = [release.cells[cell.number - 1].metadata["nbgrader"]["grade_id"] for cell in extract.code_cells(release)]
    assert kept == ["setup", "scaled_dot_product_attention", "causal_mask"]
    [cell] = extract.code_cells(cells_of("from autograde import check\nx = 1\ncheck('sdpa')"))
    assert cell.source == "\nx = 1\n"


def test_a_cell_with_a_syntax_error_is_kept_as_written():
    [cell] = extract.code_cells(cells_of("def f(:\n    pass"))
    assert cell.source == "def f(:\n    pass"


# forbidden: the static scan.

def scan(source: str, names=NOT_ALLOWED_ATTENTION) -> list[str]:
    return [v.name for v in forbidden.scan([("cell 1", source)], names)]


@pytest.mark.parametrize("source", [
    "import torch.nn.functional as F\nout = F.scaled_dot_product_attention(q, k, v)",
    "import torch\nout = torch.nn.functional.scaled_dot_product_attention(q, k, v)",
    "from torch.nn.functional import scaled_dot_product_attention as fast",
    "from torch.nn import functional as G\nG.scaled_dot_product_attention(q, k, v)",
    "import torch.nn.functional as F\nf = getattr(F, 'scaled_dot_product_attention')",
])
def test_the_scan_finds_torch_sdpa_however_it_is_named(source):
    assert scan(source) == ["torch.nn.functional.scaled_dot_product_attention"]


@pytest.mark.parametrize("source", [
    "from torch import nn\nnn.MultiheadAttention(8, 2)(x, x, x)",
    "from torch import nn\nm = nn.MultiheadAttention(8, 2)\nout = m(x, x, x)",
    "from torch import nn\nself.attn = nn.MultiheadAttention(8, 2)\nself.attn.forward(x, x, x)",
])
def test_the_scan_finds_a_call_of_nn_multiheadattention(source):
    assert scan(source) == ["torch.nn.MultiheadAttention.forward"]


@pytest.mark.parametrize("source", [
    "def scaled_dot_product_attention(q, k, v, mask=None):\n    return q, k\n"
    "out = scaled_dot_product_attention(1, 2, 3)",
    "class M:\n    def scaled_dot_product_attention(self, q):\n        return q\n"
    "    def forward(self, q):\n        return self.scaled_dot_product_attention(q)",
    "from torch import nn\ntorch_mha = nn.MultiheadAttention(8, 2)\nprint(torch_mha.in_proj_weight.shape)",
    "import torch\nw = torch.softmax(x, dim=-1)\ny = x.softmax(-1)",
    "def f(:",
])
def test_the_scan_lets_allowed_code_pass(source):
    assert scan(source) == []


def test_the_softmax_family_is_found_for_the_exercises_that_forbid_it():
    source = "import torch\nimport torch.nn.functional as F\na = x.softmax(-1)\nb = torch.logsumexp(x, -1)\n" \
             "c = F.log_softmax(x, -1)\ndef online_softmax(x):\n    return x\nd = online_softmax(x)"
    # torch.logsumexp(x) reads as a method call too: one line, reported once.
    assert scan(source, NOT_ALLOWED_SOFTMAX) == [
        "torch.Tensor.softmax", "torch.logsumexp", "torch.nn.functional.log_softmax"]


@pytest.mark.parametrize("source, names", [
    ("import torch\ny = torch._softmax(x, -1, False)", NOT_ALLOWED_SOFTMAX),
    ("y = x.log_softmax(-1)", NOT_ALLOWED_SOFTMAX),
    ("import torch\ny = torch.special.logsumexp(x, -1)", NOT_ALLOWED_SOFTMAX),
    ("from torch.nn.functional import softmin\ny = softmin(x, -1)", NOT_ALLOWED_SOFTMAX),
    ("from torch.nn.attention.flex_attention import flex_attention", NOT_ALLOWED_ATTENTION),
    ("import torch\nout = torch._native_multi_head_attention(q, k, v, 8, 2, *weights)", NOT_ALLOWED_ATTENTION),
])
def test_the_scan_finds_the_same_functions_under_other_names(source, names):
    assert len(scan(source, names)) == 1


def test_only_the_code_the_graded_functions_reach_counts():
    """A check against the library in a scratch cell is the learner's own business; a helper that
    a graded function calls, however far down, is not."""
    cells = [("cell 1", "import torch\nimport torch.nn.functional as F\n"),
             ("cell 2", "def helper(x):\n    return F.softmax(x, -1)\n"),
             ("cell 3", "def online_softmax(x, block_size):\n    return middle(x)\ndef middle(x):\n"
                        "    return helper(x)\n"),
             ("cell 4", "expected = torch.softmax(x, -1)  # a check\n")]
    exercise = exercises.get("flash_forward")
    graded, elsewhere = forbidden.scan_graded(cells, exercise)
    assert [v.where for v in graded] == ["cell 2, line 2: `return F.softmax(x, -1)`"]
    assert [v.where for v in elsewhere] == ["cell 4, line 1: `expected = torch.softmax(x, -1)  # a check`"]
    redefined = cells + [("cell 5", "def helper(x):\n    return x.exp() / x.exp().sum(-1, keepdim=True)\n")]
    assert forbidden.scan_graded(redefined, exercise)[0] == []  # the latest definition is the one handed in


# tripwire: what the scan cannot see, stopped as it runs.

def test_the_tripwire_records_and_stops_a_call_of_torch_sdpa():
    q = torch.randn(1, 2, 3, 4)
    with Tripwire(NOT_ALLOWED_ATTENTION) as tripwire:
        torch.softmax(q, dim=-1)  # allowed
        with pytest.raises(ForbiddenCall):
            F.scaled_dot_product_attention(q, q, q)
    assert [v.name for v in tripwire.violations] == ["torch.nn.functional.scaled_dot_product_attention"]


def test_the_tripwire_catches_nn_multiheadattention_in_eval_mode_too():
    torch_mha = nn.MultiheadAttention(4, 2, batch_first=True).eval()
    x = torch.randn(1, 3, 4)
    with Tripwire(NOT_ALLOWED_ATTENTION) as tripwire, torch.no_grad():
        with pytest.raises(ForbiddenCall):
            torch_mha(x, x, x)
    assert [v.name for v in tripwire.violations] == ["torch.nn.MultiheadAttention.forward"]


def test_the_tripwire_stops_flex_attention_under_its_own_name():
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 1, 8, 4)
    with Tripwire(NOT_ALLOWED_ATTENTION) as tripwire:
        with pytest.raises(ForbiddenCall):
            flex_attention(q, q, q)
    assert [v.name for v in tripwire.violations] == ["torch.nn.attention.flex_attention.flex_attention"]


def test_the_tripwire_stops_a_python_function_under_any_name_in_any_thread_and_gives_its_code_back():
    own_code = F.multi_head_attention_forward.__code__
    alias, stopped = F.multi_head_attention_forward, []

    def call_in_a_thread():
        try:
            alias()
        except ForbiddenCall:
            stopped.append(True)

    with Tripwire(NOT_ALLOWED_ATTENTION) as tripwire:
        worker = threading.Thread(target=call_in_a_thread)
        worker.start()
        worker.join()
        assert tripwire.intact()
        F.multi_head_attention_forward.__code__ = own_code  # put back by the learner: no longer standing
        assert not tripwire.intact()
    assert stopped == [True]
    assert [v.name for v in tripwire.violations] == ["torch.nn.functional.multi_head_attention_forward"]
    assert F.multi_head_attention_forward.__code__ is own_code


SOFTMAX_BY_ANOTHER_NAME = {
    "Tensor.softmax": lambda x: x.softmax(-1),
    "torch.softmax": lambda x: torch.softmax(x, -1),
    "F.softmax": lambda x: F.softmax(x, -1),
    "torch.logsumexp": lambda x: torch.logsumexp(x, -1),
    "Tensor.logsumexp": lambda x: x.logsumexp(-1),
    "F.log_softmax": lambda x: F.log_softmax(x, -1),
    "Tensor.log_softmax": lambda x: x.log_softmax(-1),
    "getattr(torch.special, 'soft' + 'max')": lambda x: getattr(torch.special, "soft" + "max")(x, -1),
    "torch.special.log_softmax": lambda x: torch.special.log_softmax(x, -1),
    "torch.special.logsumexp": lambda x: torch.special.logsumexp(x, -1),
    "F.softmin": lambda x: F.softmin(x, -1),
    "torch._softmax": lambda x: torch._softmax(x, -1, False),
    "torch.ops.aten._log_softmax": lambda x: torch.ops.aten._log_softmax(x, -1, False),
    "softmax under DisableTorchFunction": lambda x: _without_torch_functions(torch.softmax, x, -1),
}


def _without_torch_functions(function, *args):
    with torch._C.DisableTorchFunction():
        return function(*args)


@pytest.mark.parametrize("call", SOFTMAX_BY_ANOTHER_NAME.values(), ids=SOFTMAX_BY_ANOTHER_NAME)
def test_the_tripwire_stops_the_softmax_family_under_any_name(call):
    x = torch.randn(3, 4)
    with Tripwire(NOT_ALLOWED_SOFTMAX) as tripwire:
        with pytest.raises(ForbiddenCall):
            call(x)
    assert len(tripwire.violations) == 1


def _native_mha(x):
    weights = [torch.randn(12, 4), torch.randn(12), torch.randn(4, 4), torch.randn(4)]
    return torch._native_multi_head_attention(x, x, x, 4, 2, *weights)


ATTENTION_BY_ANOTHER_NAME = {
    "aten._scaled_dot_product_attention_math": lambda x: torch.ops.aten._scaled_dot_product_attention_math(x, x, x),
    "aten._scaled_dot_product_flash_attention_for_cpu":
        lambda x: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(x, x, x),
    "F.scaled_dot_product_attention under DisableTorchFunction":
        lambda x: _without_torch_functions(F.scaled_dot_product_attention, x, x, x),
    "torch._native_multi_head_attention": lambda x: _native_mha(x[0, 0]),
}


@pytest.mark.parametrize("call", ATTENTION_BY_ANOTHER_NAME.values(), ids=ATTENTION_BY_ANOTHER_NAME)
def test_the_tripwire_stops_pytorchs_attention_kernels_however_they_are_reached(call):
    x = torch.randn(1, 2, 3, 4)
    with Tripwire(NOT_ALLOWED_ATTENTION) as tripwire:
        with pytest.raises(ForbiddenCall):
            call(x)
    [violation] = tripwire.violations
    assert violation.name.split(" ")[0] in NOT_ALLOWED_ATTENTION


def test_the_tripwire_lets_attention_written_out_run_forward_and_backward():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    with Tripwire(NOT_ALLOWED_ATTENTION) as tripwire:
        (torch.softmax(q @ q.transpose(-2, -1), -1) @ q).sum().backward()
    with Tripwire(NOT_ALLOWED_SOFTMAX) as tripwire_without_softmax:
        scores = q @ q.transpose(-2, -1)
        weights = (scores - scores.amax(-1, keepdim=True)).exp()
        (weights / weights.sum(-1, keepdim=True) @ q).sum().backward()
    assert tripwire.violations == tripwire_without_softmax.violations == []
    assert q.grad is not None and torch.isfinite(q.grad).all()


# forbidden: what is shown to a person (status `review`).

@pytest.mark.parametrize("line, evidence", [
    ("    with torch.utils._python_dispatch._disable_current_modes():\n        pass", "torch.utils._python_dispatch"),
    ("    f = torch.ops.aten.mm", "torch.ops.aten.mm"),
    ("    f = torch._C._nn.linear", "torch._C._nn.linear"),
    ("    f = getattr(torch.special, 'soft' + 'max')", "getattr(...)"),
    ("    f = sys.modules['torch']", "sys.modules"),
    ("    f = importlib.import_module('torch')", "importlib"),
    ("    f = eval('q')", "eval(...)"),
])
def test_the_review_scan_shows_what_reaches_torchs_internals(line, evidence):
    cells = [("cell 1", "import sys\nimport importlib\nimport torch\nif 'google.colab' in sys.modules:\n    pass\n"),
             ("cell 2", f"def causal_mask(L, S=None, device=None):\n    return helper()\ndef helper():\n{line}\n"),
             ("cell 3", "def unused():\n    return torch._C\n")]
    [found] = forbidden.review(cells, exercises.get("sdpa"))
    assert found.name.startswith(evidence), found


def test_honest_code_and_the_solutions_need_no_review():
    cells = [("cell 1", "import sys\nimport torch\nif 'google.colab' in sys.modules:\n    pass\n"
                        "def causal_mask(L, S=None, device=None):\n    return torch.ones(L, S).tril(S - L).bool()\n")]
    assert forbidden.review(cells, exercises.get("sdpa")) == []
    for exercise in exercises.EXERCISES.values():
        solution = nbformat.read(Path("solutions") / exercise.notebook, as_version=4)
        cells = [(f"cell {i}", cell.source) for i, cell in enumerate(solution.cells) if cell.cell_type == "code"]
        assert forbidden.review(cells, exercise) == [], exercise.id


@pytest.mark.parametrize("line, evidence", [
    ("    import numpy as np\n    return np.asarray(x)", "numpy: computes outside torch"),
    ("    return torch.from_numpy(x.detach().numpy())", ".numpy(): computes outside torch"),
])
def test_numpy_is_shown_where_rules_are_measured_in_the_learners_process(line, evidence):
    cells = [("cell 1", "import torch\n"),
             ("cell 2", f"def online_softmax(x, block_size):\n    return helper(x)\ndef helper(x):\n{line}\n")]
    [found] = forbidden.review(cells, exercises.get("flash_forward"))
    assert found.name.startswith(evidence), found
    sdpa = [cells[0], ("cell 2", cells[1][1].replace("online_softmax(x, block_size)", "causal_mask(x)"))]
    assert forbidden.review(sdpa, exercises.get("sdpa")) == []  # no rule there for numpy to escape


def test_a_grade_for_review_keeps_its_points_and_says_why():
    exercise = exercises.get("sdpa")
    results = (CaseResult("a", 2.0, True, "", ""), CaseResult("b", 3.0, False, "", "", ("wrong",)))
    graded = grade.Grade(exercise, grade.INCOMPLETE, "stopped", results)
    evidence = [forbidden.Violation("torch._C", "cell 2, line 4: `f = torch._C`").describe()]
    reviewed = grade._for_review(graded, evidence)
    assert (reviewed.status, reviewed.score) == (grade.REVIEW, graded.score) == ("review", 2.0)
    assert reviewed.reason == "uses torch._C (cell 2, line 4: `f = torch._C`); incomplete: stopped"
    not_counted = grade.Grade(exercise, grade.NOT_ALLOWED, "uses F.sdpa", results)
    assert grade._for_review(not_counted, evidence) is not_counted
    assert grade._for_review(graded, []) is graded


# wire: what comes back from the worker is checked before it is believed.

def test_an_array_round_trips_with_its_shape_and_dtype(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    read = wire.read_array(tmp_path / "a.npy")
    assert (read.shape, read.dtype) == ((2, 3), np.dtype(np.float32))
    np.testing.assert_array_equal(read, np.arange(6).reshape(2, 3))


def test_a_pickled_object_array_is_refused(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(wire.WireError, match="not a plain numeric dtype"):
        wire.read_array(tmp_path / "a.npy")


def test_arrays_are_written_byte_for_byte_as_numpy_writes_them_and_read_in_that_form_only(tmp_path: Path):
    """The wire writes and parses .npy headers itself: what it writes is what `np.save` writes of the
    array in C order, for any axes (none, one, sixteen, a transposed view); a Fortran-ordered file,
    which it never writes, is refused."""
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n, array in enumerate([np.float32(2.5) * np.ones(()), np.arange(7, dtype=np.int64),
                                   np.arange(12, dtype=np.float16).reshape(3, 4).T, np.zeros((0, 3), dtype=bool),
                                   np.ones((1,) * 16, dtype=np.uint8)]):
            wire.save_array(folder, f"ours{n}.npy", array)
            np.save(tmp_path / f"numpy{n}.npy", array.copy(order="C"))
            assert (tmp_path / f"ours{n}.npy").read_bytes() == (tmp_path / f"numpy{n}.npy").read_bytes()
            read = wire.read_array(tmp_path / f"ours{n}.npy")
            assert (read.shape, read.dtype) == (array.shape, array.dtype)
            np.testing.assert_array_equal(read, array)
    finally:
        os.close(folder)
    np.save(tmp_path / "fortran.npy", np.asfortranarray(np.zeros((2, 3))))
    with pytest.raises(wire.WireError, match="not an .npy array in C order"):
        wire.read_array(tmp_path / "fortran.npy")


def test_an_array_whose_size_disagrees_with_its_header_is_refused(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.zeros(10))
    with (tmp_path / "a.npy").open("ab") as file:
        file.write(b"extra")
    with pytest.raises(wire.WireError, match="does not match its header"):
        wire.read_array(tmp_path / "a.npy")


def test_a_result_is_read_by_its_header_not_by_its_label(tmp_path: Path):
    """float64 values labelled float32 are float64; a label counts only where numpy lacks the dtype."""
    np.save(tmp_path / "out.npy", np.zeros((2, 3)))
    got = wire.decode_result({"tensor": "out.npy", "dtype": "torch.float32", "device": "cpu"}, tmp_path)
    assert (got.shape, got.dtype) == ((2, 3), "torch.float64")
    np.save(tmp_path / "half.npy", np.zeros(2, dtype=np.float32))
    assert wire.decode_result({"tensor": "half.npy", "dtype": "torch.bfloat16", "device": "cpu"},
                              tmp_path).dtype == "torch.bfloat16"


def test_a_reply_naming_too_many_arrays_is_refused_before_they_are_read(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.zeros(4))
    many = {"list": [{"tensor": "a.npy", "dtype": "torch.float64", "device": "cpu"}] * 100}
    with pytest.raises(wire.WireError, match="more than"):
        wire.decode_result({"list": [many, many]}, tmp_path)


@pytest.mark.parametrize("encoded", [
    {"tensor": "../../etc/passwd.npy", "dtype": "x", "device": "cpu"},
    {"value": [1, 2]},
    {"dict": "nothing"},
    {"dict": [["a"]]},
    {"list": [{"value": 1}] * 300},
    [],
])
def test_a_malformed_result_is_refused(tmp_path: Path, encoded):
    with pytest.raises(wire.WireError):
        wire.decode_result(encoded, tmp_path)


def test_a_result_file_that_is_not_json_or_too_large_is_refused(tmp_path: Path):
    (tmp_path / "result.json").write_text("{not json")
    with pytest.raises(wire.WireError, match="not valid JSON"):
        wire.read_json(tmp_path / "result.json")
    (tmp_path / "result.json").write_text(" " * (wire.MAX_JSON_BYTES + 1))
    with pytest.raises(wire.WireError, match="larger than"):
        wire.read_json(tmp_path / "result.json")


# compare: the messages name the place and the size of a difference.

def test_compare_reports_the_largest_error_and_where():
    expected = observe_tensor(torch.zeros(2, 3, dtype=torch.float64))
    got = observe_tensor(torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, -0.1]], dtype=torch.float32))
    assert compare_tensor("out", expected, got, "torch.float32", "cpu") == [
        "`out`: max abs error 0.5 at index (1, 1) (expected 0, got 0.5); tolerance 1e-05"]


def test_compare_reports_nans_dtype_and_other_types():
    expected = observe_tensor(torch.zeros(2, 2, dtype=torch.float64))
    got = observe_tensor(torch.tensor([[0.0, float("nan")], [0.0, 0.0]], dtype=torch.float64))
    assert compare_tensor("w", expected, got, "torch.float32", "cpu") == [
        "`w`: expected dtype torch.float32 (the dtype of the first tensor argument), got torch.float64",
        "`w`: 1 NaN where the expected values are not NaN, first at index (0, 1)"]
    assert compare_tensor("w", expected, OtherValue("list"), "torch.float64", "cpu") == [
        "`w`: expected a tensor of shape (2, 2), got a list"]


def test_a_signalling_nan_is_reported_without_a_warning():
    """Memory a submission left uninitialised may hold signalling NaNs, whose cast to float64 made
    numpy warn in the grader's log ("invalid value encountered in cast")."""
    bits = torch.tensor([0x7FA00000, 0x3F800000], dtype=torch.int32)  # a signalling NaN, then 1.0
    got = observe_tensor(bits.view(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compare_tensor("out", observe_tensor(torch.ones(2)), got, "torch.float32", "cpu") == [
            "`out`: 1 NaN where the expected values are not NaN, first at index (0,)"]


def test_compare_accepts_errors_within_the_tolerance_relative_to_the_scale():
    expected = observe_tensor(torch.full((3,), 100.0, dtype=torch.float64))
    got = observe_tensor(torch.full((3,), 100.0005, dtype=torch.float32))
    assert compare_tensor("out", expected, got, "torch.float32", "cpu") == []


# seeds and the exercise data.

def test_visible_inputs_are_fixed_and_hidden_inputs_follow_the_seed():
    first = lambda seed, test: sent_inputs("sdpa", seed)[test][0]  # noqa: E731
    assert torch.equal(first(None, "no-mask"), first(1, "no-mask"))
    hidden = "random-shapes[4-D inputs (batch and heads), L < S, float64]"
    assert torch.equal(first(1, hidden)["q"], first(1, hidden)["q"])
    assert first(1, hidden).describe() != first(2, hidden).describe()
    assert hidden not in sent_inputs("sdpa", None)  # hidden tests need the instructor's seed


def test_the_reference_keeps_one_submitters_hidden_results_at_a_time():
    """The visible tests make the same calls for every notebook: their results are kept for the
    process. A hidden test's inputs are one submitter's: kept, they would grow with the class."""
    reference = Reference(exercises.get("sdpa"))

    def inputs(seed: int) -> cases.Inputs:
        generator = torch.Generator().manual_seed(seed)
        return cases.Inputs({name: torch.randn(1, 2, 3, 4, generator=generator, dtype=torch.float64)
                             for name in "qkv"})

    visible = reference.attend(inputs(0))
    assert reference.attend(inputs(0)) is visible
    with reference.drawn_from(7):
        hidden = reference.attend(inputs(1))
        assert reference.attend(inputs(1)) is hidden
        assert reference.attend(inputs(0)) is visible
    with reference.drawn_from(7):  # the same submitter's next hidden test
        assert reference.attend(inputs(1)) is hidden
    with reference.drawn_from(8):  # the next submitter's
        again = reference.attend(inputs(1))
    assert again is not hidden and np.array_equal(again["out"].array, hidden["out"].array)
    assert reference.attend(inputs(0)) is visible


def test_the_reference_answers_by_an_oracle_marked_after_it_was_made(monkeypatch):
    """`check()` makes the reference before the tests' module, which marks the oracles, is imported:
    the oracle is looked up at each call, not when the reference is made."""
    from autograde.exercises import sdpa

    reference = Reference(exercises.get("sdpa"))
    inputs = cases.Inputs({name: torch.ones(1, 1, 2, 2, dtype=torch.float64) for name in "qkv"})
    assert np.array_equal(reference.attend(inputs)["out"].array, np.ones((1, 1, 2, 2)))  # the solution's
    monkeypatch.setattr(sdpa.attend, "__autograde_oracle__", lambda given: {"out": given["q"] * 7}, raising=False)
    other = cases.Inputs({name: 2 * torch.ones(1, 1, 2, 2, dtype=torch.float64) for name in "qkv"})
    assert np.array_equal(reference.attend(other)["out"].array, 14 * np.ones((1, 1, 2, 2)))


@pytest.mark.parametrize("exercise", exercises.EXERCISES.values(), ids=lambda e: e.id)
def test_each_exercise_is_worth_10_points_over_visible_and_hidden_tests(exercise):
    assert max_score(exercise) == 10
    assert {case.visible for case in catalogue(exercise)} == {True, False}
    assert all(set(case.uses) <= set(exercise.required) for case in catalogue(exercise))
    assert all(resolve(name) for name in exercise.not_allowed)


def test_the_time_left_weighs_each_notebook_by_its_exercise_and_skips_missing_ones():
    from autograde.grading.batch import TimeLeft

    clock = TimeLeft(jobs=2)
    assert clock.left(Counter([("flash_forward", True)])) is None  # nothing measured yet: no guess
    clock.done("sdpa", 2.0)
    assert clock.left(Counter([("flash_forward", True)])) == 2.0  # an unmeasured exercise: the mean of all
    clock.done("flash_forward", 10.0)
    # Two processes share 10 + 10 + 2 s; a missing notebook costs nothing.
    assert clock.left(Counter([("flash_forward", True), ("flash_forward", True), ("sdpa", True), ("sdpa", False)])) \
        == 11.0
    # The last notebook is never "0 s left": one process still needs all of its time.
    assert clock.left(Counter([("flash_forward", True)])) == 10.0
    assert clock.left(Counter({("flash_forward", True): 0, ("sdpa", True): 1})) == 2.0  # none left of one
    assert clock.left(Counter()) == 0.0


def test_the_time_left_is_within_30_percent_after_the_first_tenth_of_a_class():
    """A class graded by two processes in the batch's order (student by student), each exercise at its
    own cost (the README's CPU seconds) give or take 20%: from a tenth of the notebooks on, the estimate
    the progress bar shows is within 30% of the time the run still takes, until the last few (the last
    hundredth: there, what the notebooks being graded have already spent is a large part of what is left,
    and the estimate counts them whole)."""
    import heapq
    import random

    from autograde.grading.batch import TimeLeft

    cost = {"sdpa": 0.14, "mha": 0.46, "gqa": 0.44, "kv_cache": 0.53, "rope": 0.26, "mla": 0.22,
            "flash_forward": 2.11, "flash_backward": 1.59, "flash_triton": 1.21, "split_kv": 0.59,
            "paged_kv": 0.19, "window": 0.61}
    draw = random.Random(0)
    tasks = [(exercise, seconds * draw.uniform(0.8, 1.2)) for _ in range(50) for exercise, seconds in cost.items()]
    clock, free, running, finished, estimates = TimeLeft(jobs=2), [0.0, 0.0], [], [], []
    queue = iter(tasks)
    for task in itertools.islice(queue, 2):  # each process takes a notebook, then the next when it is done
        heapq.heappush(running, (heapq.heappop(free) + task[1], task))
    remaining = list(tasks)
    while running:
        now, (exercise, seconds) = heapq.heappop(running)
        clock.done(exercise, seconds)
        remaining.remove((exercise, seconds))
        finished.append(now)
        estimates.append((now, clock.left(Counter((name, True) for name, _ in remaining))))
        following = next(queue, None)
        if following is not None:
            heapq.heappush(running, (now + following[1], following))
    end = finished[-1]
    checked = [(now, guess) for now, guess in estimates[len(tasks) // 10:-len(tasks) // 100]]
    worst = max(abs(guess - (end - now)) / (end - now) for now, guess in checked)
    assert worst <= 0.3, worst


def test_a_renamed_notebook_is_found_the_same_way_by_the_class_grader_and_by_gradescope(tmp_path):
    from autograde.grading import batch
    from autograde.submission import locate

    folder = tmp_path / "ada" / "gqa"
    folder.mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(), folder / "GQA.ipynb")  # upper case: a case-blind match
    gqa, kv_cache = exercises.get("gqa"), exercises.get("kv_cache")
    path, notes = batch.located(tmp_path, "ada", gqa)
    assert path == folder / "GQA.ipynb"
    assert notes == ("graded GQA.ipynb as gqa.ipynb: it looks renamed; please name it gqa.ipynb",)
    (found, _), _ = locate.find_all([gqa, kv_cache], folder)
    assert (found.path, (found.note,)) == (path, notes)
    assert batch.located(tmp_path, "ada", kv_cache) == (folder / "kv_cache.ipynb", ())  # nothing looks like it


def test_a_notebook_over_the_size_limit_is_read_without_its_outputs_and_says_so(tmp_path):
    source = nbformat.v4.new_code_cell("x = 1")
    source.outputs = [nbformat.v4.new_output("stream", text="y" * (notebook.MAX_BYTES + 2**20))]
    path = tmp_path / "sdpa.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[source]), path)
    size = path.stat().st_size / 2**20
    loaded, notes = notebook.load_with_notes(path)
    assert loaded.cells[0].outputs == [] and loaded.cells[0].source == "x = 1"
    assert len(notes) == 1 and f"is {size:.1f} MiB" in notes[0] and "graded without its outputs" in notes[0]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("#" * (notebook.MAX_BYTES + 1))]), path)
    with pytest.raises(notebook.NotebookError, match="without its outputs: more than the 20.0 MiB allowed"):
        notebook.load_with_notes(path)


def test_what_refuses_user_namespaces_is_named(tmp_path, monkeypatch):
    # In the order of USER_NAMESPACE_SETTINGS: AppArmor's restriction on, the clone sysctl permissive,
    # max_user_namespaces 0.
    files = []
    for number, value in enumerate(("1", "1", "0")):
        files.append(tmp_path / f"setting-{number}")
        files[-1].write_text(f"{value}\n")
    monkeypatch.setattr(isolation, "USER_NAMESPACE_SETTINGS", tuple(
        (str(file), refusing, name) for file, (_, refusing, name) in zip(files, isolation.USER_NAMESPACE_SETTINGS)))
    assert isolation.user_namespaces_refusal() == (
        "User namespaces are refused here by AppArmor (kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu's "
        "default since 23.10) and the sysctl user.max_user_namespaces=0")
    monkeypatch.setattr(isolation, "USER_NAMESPACE_SETTINGS", ((str(tmp_path / "absent"), "1", "absent"),))
    assert isolation.user_namespaces_refusal().startswith("No sysctl refuses user namespaces here")


# Hidden inputs per submitter: the instructor's secret seed keys an HMAC of the submitter's name.

def test_each_submitter_draws_other_hidden_inputs_and_a_regrade_the_same():
    seeds = {who: cases.submission_seed(12345, who) for who in ("ada", "bert", "")}
    assert len(set(seeds.values())) == 3
    assert cases.submission_seed(12345, "ada") == seeds["ada"] != cases.submission_seed(12346, "ada")
    draws = [cases.Draw(cases.test_seed("sdpa", "hidden-random", seed)).normal(4) for seed in seeds.values()]
    assert not torch.equal(draws[0], draws[1])


def test_the_grader_nbgrader_and_pytest_name_the_same_submitter(tmp_path, monkeypatch):
    from autograde.frontends import nbgrader as nbgrader_cells

    notebook_path = tmp_path / "autograded" / "ada" / "attention" / "sdpa.ipynb"
    assert cases.submitter_of(notebook_path) == "ada"
    notebook_path.parent.mkdir(parents=True)
    monkeypatch.chdir(notebook_path.parent)  # where nbgrader runs the notebook
    monkeypatch.setenv("AUTOGRADE_SEED", "12345")
    assert nbgrader_cells.graded_seed() == cases.submission_seed(12345, "ada") == nbgrader_cells.hidden_seed()
    monkeypatch.delenv("AUTOGRADE_SEED")
    assert nbgrader_cells.graded_seed() is None


def test_gradescope_names_the_submitter_by_the_users_ids(tmp_path):
    from autograde.frontends import gradescope

    assert gradescope.submitter(tmp_path) == ""  # no metadata: one seed for all, still the instructor's secret
    (tmp_path / "submission_metadata.json").write_text(json.dumps({"users": [{"id": 7, "name": "B"},
                                                                             {"id": 3, "name": "A"}]}))
    assert gradescope.submitter(tmp_path) == "3,7"


def test_a_learners_kernel_measures_a_call_with_torch_on_one_thread_then_gives_its_threads_back():
    """The CPU time of a call measured in the learner's kernel counts one torch thread, as the grader's
    worker runs: waiting threads spin, the longer the busier the machine, and the process's CPU time
    counts their spinning."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with LocalSubmission(exercises.get("flash_forward"), {}).cost_measured() as cost:
            inside = torch.get_num_threads()
            torch.ones(256, 256) @ torch.ones(256, 256)
        assert (inside, torch.get_num_threads()) == (1, 2)
        assert cost.cpu_seconds is not None and cost.cpu_seconds >= 0
    finally:
        torch.set_num_threads(threads)


SPINNER = """
import sys, threading, time

def spin(seconds):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass

for line in sys.stdin:
    where, seconds = line.split()
    if where == "thread":
        worker = threading.Thread(target=spin, args=(float(seconds),))
        worker.start()
        worker.join()
    else:
        spin(float(seconds))
    print("done", flush=True)
"""


def test_the_cpu_time_measured_from_outside_is_exact_and_counts_a_thread_that_ended():
    """A process's CPU time between two readings, as the fork server takes it: its CPU-time clock, to
    the nanosecond, where its ticks of 10 ms would be off by up to two; a thread that did the work and
    ended before the second reading counted too."""
    from autograde.sandbox import procfs

    spinner = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        def measured(where: str, seconds: float) -> float:
            before = procfs.cpu_clock_ns(spinner.pid)
            spinner.stdin.write(f"{where} {seconds}\n")
            spinner.stdin.flush()
            assert spinner.stdout.readline() == "done\n"
            return (procfs.cpu_clock_ns(spinner.pid) - before) / 1e9

        measured("main", 0.01)  # the interpreter's first loop, not measured
        spun = [measured(where, 0.05) for where in ("main", "thread", "main", "thread")]
        assert all(0.05 <= seconds < 0.055 for seconds in spun), spun
    finally:
        spinner.kill()
        spinner.wait()
    assert procfs.cpu_clock_ns(spinner.pid) is None  # gone


def test_alternating_dtypes_give_every_value_of_every_axis_both_dtypes_at_half_the_cases():
    product = {f"{a}, {b}, {c}": (a, b, c) for a in ("L < S", "L = S", "L > S") for b in ("x", "y")
               for c in ("causal", "not causal")}
    alternated = cases.alternate_dtypes(product)
    assert len(alternated) == len(product) == 12
    assert [case.rsplit(", ", 1)[0] for case in alternated] == list(product)
    for position in range(3):
        for value in {axes[position] for axes in product.values()}:
            met = [axes[-1] for axes in alternated.values() if axes[position] == value]
            assert sorted(set(met)) == ["float32", "float64"]
    assert sum(axes[-1] == "float32" for axes in alternated.values()) == 6
    with pytest.raises(ValueError, match="meets"):  # one axis: a value cannot meet both dtypes
        cases.alternate_dtypes({"a": ("a",), "b": ("b",)})


def test_grading_processes_share_the_exercises_out_and_each_keeps_to_those_it_began():
    from autograde.grading.batch import ExercisesShared

    sdpa, mha, gqa = (exercises.get(e) for e in ("sdpa", "mha", "gqa"))
    tasks = [(student, exercise) for student in ("ada", "bo", "cy") for exercise in (sdpa, mha, gqa)]
    shared = ExercisesShared(tasks)
    handed = shared.first(2)
    assert [(s, e.id) for s, e in handed] == [("ada", "sdpa"), ("ada", "mha")]  # two exercises, one each

    def after(process: int, exercise_id: str) -> tuple[str, str]:
        """What `process` is handed after a notebook of `exercise_id`, as (student, exercise)."""
        task = shared.done(process, exercise_id)
        handed.append(task)
        return task[0], task[1].id

    # Process 1 keeps to sdpa, process 2 to mha; the first to run out begins gqa, which no one has.
    assert [after(1, "sdpa"), after(1, "sdpa"), after(1, "sdpa")] == [("bo", "sdpa"), ("cy", "sdpa"), ("ada", "gqa")]
    assert [after(2, "mha"), after(2, "mha")] == [("bo", "mha"), ("cy", "mha")]
    # Nothing of its own left and nothing unbegun: it helps with the exercise that has the most left.
    assert after(2, "mha") == ("bo", "gqa")
    while (following := shared.done(2, "gqa")) is not None:
        handed.append(following)
    assert sorted((s, e.id) for s, e in handed) == sorted((s, e.id) for s, e in tasks)  # each once
    assert shared.done(1, "gqa") is None
