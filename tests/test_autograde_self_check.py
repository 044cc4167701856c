"""`check(...)` in a learner's notebook, and the nbgrader test cells' `run(...)`."""

from __future__ import annotations

import pytest

from autograde import check
from autograde.frontends.nbgrader import run
from tests.fixtures.implementations import SDPA_WRONG
from tests.fixtures.notebooks import SEED, answer

pytestmark = pytest.mark.timeout(300)
SDPA = "scaled_dot_product_attention"


def namespace_of(*sources: str) -> dict:
    """A notebook's globals after running `sources`, as a learner's kernel holds them."""
    namespace = {"__name__": "__main__"}
    for source in sources:
        exec(source, namespace)
    return namespace


def reference_sdpa() -> dict:
    return namespace_of(answer("sdpa", "scaled_dot_product_attention"), answer("sdpa", "causal_mask"))


def test_check_prints_a_summary_with_points_and_what_is_wrong(capsys):
    wrong = next(v for v in SDPA_WRONG if v.name == "top-left-causal-mask")
    namespace = namespace_of(answer("sdpa", "scaled_dot_product_attention"), wrong.answers["causal_mask"])
    check("sdpa", namespace=namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == 'check("sdpa"): 5 of 6 points from the visible tests (hidden tests add 4 more at grading)'
    assert lines[0].split() == ["PASS", "no-mask", "1.5/1.5", "outputs", "and", "weights", "without", "a", "mask"]
    failing = lines.index(next(line for line in lines if line.startswith("FAIL")))
    assert lines[failing].split()[:3] == ["FAIL", "causal-mask-rectangular", "0/1"]
    assert lines[failing + 1].strip() == "inputs: calls=[(3, 6), (6, 3), (1, 4), (4, 1)]; L < S and L > S"
    assert lines[failing + 2].strip().startswith("`causal_mask(3, 6)`: 9 of 18 entries differ")


def test_check_reads_the_callers_globals_and_can_run_one_functions_tests(capsys):
    namespace = reference_sdpa()
    exec('from autograde import check\ncheck("sdpa", "causal_mask")', namespace)
    out = capsys.readouterr().out
    assert out.endswith('check("sdpa"): 1.5 of 1.5 points from the visible tests\n')
    assert "no-mask" not in out and "causal-mask-square" in out
    with pytest.raises(ValueError, match="'sdpa' has no function 'split_heads'"):
        check("sdpa", "split_heads", namespace=namespace)


def test_check_warns_about_a_not_allowed_call_in_a_graded_function(capsys):
    namespace = reference_sdpa()
    helper = "import torch.nn.functional as F\ndef fast(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)"
    uses = "def scaled_dot_product_attention(q, k, v, mask=None):\n    return fast(q, k, v), None"
    namespace["In"] = ["", helper, answer("sdpa", SDPA), uses, answer("sdpa", SDPA)]
    check("sdpa", namespace=namespace)  # In [3] was replaced by In [4]: nothing counts
    assert "NOT ALLOWED" not in capsys.readouterr().out
    namespace["In"] = namespace["In"][:4]
    check("sdpa", namespace=namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("NOT ALLOWED: uses torch.nn.functional.scaled_dot_product_attention (In [1], line 3: ")
    assert lines[-1].startswith('check("sdpa"): the grader gives this exercise 0 points, whatever the tests')


def test_check_only_notes_a_call_outside_the_graded_functions(capsys):
    namespace = reference_sdpa()
    namespace["In"] = ["", "import torch.nn.functional as F\nF.scaled_dot_product_attention(q, k, v)"]
    check("sdpa", namespace=namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["note: uses torch.nn.functional.scaled_dot_product_attention (In [1], line 2: "
                          "`F.scaled_dot_product_attention(q, k, v)`) is outside the graded functions: not counted",
                          'check("sdpa"): 6 of 6 points from the visible tests (hidden tests add 4 more at grading)']


def test_an_nbgrader_test_cell_passes_or_says_why_not(monkeypatch, capsys):
    monkeypatch.setenv("AUTOGRADE_SEED", str(SEED))
    run("sdpa", "no-mask", reference_sdpa())
    run("sdpa", "random-shapes", reference_sdpa())
    assert capsys.readouterr().out == "test no-mask passed\ntest random-shapes passed\n"
    broken = namespace_of(answer("sdpa", "scaled_dot_product_attention").replace("/ math.sqrt(q.shape[-1])", ""))
    with pytest.raises(AssertionError, match=r"test no-mask failed\ninputs: q \(2, 3, 4, 8\) float64"):
        run("sdpa", "no-mask", broken)
    # Each case by its axes only, nothing about hidden inputs.
    with pytest.raises(AssertionError, match=r"\A(hidden test random-shapes\[[^\]\n]+\] failed(\n|\Z))+\Z"):
        run("sdpa", "random-shapes", broken)


def test_an_nbgrader_test_cell_scores_0_for_a_not_allowed_call(monkeypatch):
    namespace = reference_sdpa()
    namespace["In"] = ["", "from torch.nn.functional import scaled_dot_product_attention as fast\n",
                       answer("sdpa", SDPA).replace("weights = torch.softmax(scores, dim=-1)",
                                                    "weights = torch.softmax(scores, dim=-1)\n    fast")]
    with pytest.raises(AssertionError, match="not allowed in sdpa, so every test scores 0"):
        run("sdpa", "causal-mask-square", namespace)


def test_a_hidden_test_without_a_seed_draws_one_and_says_which(monkeypatch, capsys):
    monkeypatch.delenv("AUTOGRADE_SEED", raising=False)
    run("sdpa", "random-shapes", reference_sdpa())
    assert capsys.readouterr().out.startswith("AUTOGRADE_SEED is not set: hidden inputs drawn with seed ")
