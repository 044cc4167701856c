"""The exercises `sdpa` and `mha`: graded end to end, and what each wrong answer loses on every seed.

The hidden tests are parametrised by the contract's axes (leading dimensions, lengths, dtypes,
mask shapes, fully masked rows, self- and cross-attention, biases, heads, defaults), so what a
wrong answer loses does not depend on the seed: every one is graded on several seeds and must
lose exactly its tests on each. The references' gradients through fully masked rows are checked
against PyTorch's attention, an oracle that is not the course's code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autograde import registry as exercises
from autograde import solutions
from autograde.cases import FLOAT_DTYPES
from autograde.grading.session import catalogue, max_score
from tests.fixtures.implementations import (
    MHA_RIGHT,
    MHA_TESTS,
    MHA_WRONG,
    SDPA_RIGHT,
    SDPA_TESTS,
    SDPA_WRONG,
    Variant,
    variant_id,
)
from tests.fixtures.notebooks import (
    failed,
    grade_in_process,
    graded_on_seed,
    learner_notebook,
    lost,
    on_every_seed,
    sent_inputs,
)

pytestmark = pytest.mark.timeout(120)

SDPA = solutions.namespace(exercises.get("sdpa"))
MHA = solutions.namespace(exercises.get("mha"))
GRADED_WRONG = [variant for variant in SDPA_WRONG + MHA_WRONG if not variant.not_allowed]


# Wrong answers lose exactly the tests they break, on every seed; right answers in other styles pass.

@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", GRADED_WRONG, ids=variant_id)
@on_every_seed()
def test_a_wrong_answer_loses_exactly_its_tests_on_every_seed(variant: Variant, seed):
    assert not variant.hidden_may_fail  # the parameters, not the seed, decide what a wrong answer loses
    names = {test.name for test in catalogue(exercises.get(variant.exercise))}
    assert variant.visible_failures | variant.hidden_failures <= names  # the names of tests that exist
    assert variant.visible_failures | variant.hidden_failures, "a wrong answer must lose points"
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    visible, hidden = lost(results)
    assert (seed, visible) == (seed, variant.visible_failures)
    assert (seed, hidden) == (seed, variant.hidden_failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", SDPA_RIGHT + MHA_RIGHT, ids=variant_id)
@on_every_seed()
def test_a_right_answer_in_another_style_passes_every_test_on_every_seed(variant: Variant, seed):
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    assert (seed, failed(results)) == (seed, set())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exercise_id", ["sdpa", "mha"])
@on_every_seed()
def test_the_solution_keeps_full_marks_on_every_seed(exercise_id: str, seed):
    assert max_score(exercises.get(exercise_id)) == 10
    results = graded_on_seed(exercise_id, None, seed)
    assert (seed, failed(results)) == (seed, set())
    assert sum(result.points for result in results.values()) == 10


@pytest.mark.parametrize("exercise_id", ["sdpa", "mha"])
def test_a_nan_gradient_is_told_where_it_is(exercise_id: str):
    """The additive mask: its forward is right, its gradients are NaN on the fully masked rows."""
    variant = next(v for v in GRADED_WRONG
                   if (v.exercise, v.name) == (exercise_id, "additive-mask-zeroed-after-softmax"))
    results, _ = grade_in_process(exercise_id, learner_notebook(exercise_id, variant.answers))
    first = "q.grad" if exercise_id == "sdpa" else "query.grad"
    assert any(problem.startswith(f"`{first}`: ") and "NaN" in problem
               for problem in results["gradients"].problems), results["gradients"].problems


def test_a_dropout_is_told_by_the_mode():
    variant = next(v for v in GRADED_WRONG if v.name == "dropout-in-train-mode")
    results, _ = grade_in_process("mha", learner_notebook("mha", variant.answers))
    problems = results["no-dropout"].problems
    assert any(problem.startswith("`in train() mode: out`: ") for problem in problems), problems
    assert not any("eval() mode" in problem for problem in problems), problems


# The hidden inputs are what their case names say, whatever the seed.

@pytest.mark.timeout(300)
@on_every_seed(tuple(range(8)))
def test_the_hidden_inputs_of_sdpa_are_what_their_case_names_say(seed):
    sent = sent_inputs("sdpa", seed)
    for case, (leading, lengths, dtype) in SDPA_TESTS.SHAPE_CASES.items():
        (inputs,) = sent[f"random-shapes[{case}]"]
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        assert q.dim() == k.dim() == v.dim() == SDPA_TESTS.LEADING[leading] + 2
        assert min(q.shape[:-2] or (2,)) >= 2  # no singleton leading dimension
        L, S = q.shape[-2], k.shape[-2]
        assert {"L < S": L < S, "L = S": L == S, "L > S": L > S}[lengths] and min(L, S) >= 2
        assert q.shape[-1] != v.shape[-1] and q.shape[-1] >= 2
        assert q.dtype == k.dtype == v.dtype == SDPA_TESTS.DTYPES[dtype]
    for case, (shape, rows) in SDPA_TESTS.MASK_CASES.items():
        (inputs,) = sent[f"random-masks[{case}]"]
        B, H, L, _ = inputs["q"].shape
        S = inputs["k"].shape[-2]
        mask = inputs["mask"]
        assert min(B, H, L, S) >= 2 and inputs["q"].dtype == torch.float64
        assert tuple(mask.shape) == SDPA_TESTS.mask_shape(shape, B, H, L, S)
        keys = mask.sum(dim=-1)
        assert (keys == 0).any() == (rows == "fully masked rows")
        assert (keys[keys > 0] >= 2).all()  # a row with one key has weight 1 whatever its scores
    (inputs,) = sent["gradients"]
    assert (~inputs["mask"].any(dim=-1)).any() and inputs["dout"].shape[:-1] == inputs["q"].shape[:-1]
    (inputs,) = sent["causal-attention"]
    assert inputs["q"].shape[-2] > inputs["k"].shape[-2] >= 2
    (inputs,) = sent["causal-mask-random"]
    for calls in (inputs["calls"], inputs["device_calls"]):  # every axis value, with and without a device
        assert {len(args) == 1 for args in calls} == {True, False}
        assert {(args[0] > args[1]) - (args[0] < args[1]) for args in calls if len(args) == 2} == {-1, 0, 1}


@pytest.mark.timeout(300)
@on_every_seed(tuple(range(8)))
def test_the_hidden_inputs_of_mha_are_what_their_case_names_say(seed):
    sent = sent_inputs("mha", seed)
    for case, (kind, mask, bias, heads, dtype) in MHA_TESTS.ATTENTION_CASES.items():
        (inputs,) = sent[f"attention-random[{case}]"]
        B, L, _ = inputs["query"].shape
        S = inputs["key"].shape[1]
        H = inputs["num_heads"]
        assert min(B, L, S) >= 2 and (H == 1) == (heads == "1 head")
        same = torch.equal(inputs["query"], inputs["key"]) and torch.equal(inputs["key"], inputs["value"])
        assert same == (kind == "self-attention")
        assert inputs["bias"] == MHA_TESTS.BIASES[bias] == ("q_proj.bias" in inputs.values)
        shapes = {"no mask": None, "mask (L, S)": (L, S), "mask (B, 1, L, S)": (B, 1, L, S),
                  "mask (B, H, L, S)": (B, H, L, S)}
        assert (None if inputs.get("mask") is None else tuple(inputs["mask"].shape)) == shapes[mask]
        assert inputs["query"].dtype == FLOAT_DTYPES[dtype]
    for case in MHA_TESTS.DEFAULTS:
        (inputs,) = sent[f"default-key-value[{case}]"]
        assert "value" not in inputs.values and inputs["num_heads"] > 1
        assert ("key" in inputs.values) == (case == "value left to its default")
    for case in MHA_TESTS.HEADS:
        (inputs,) = sent[f"load-torch-mha-no-bias[{case}]"]
        assert (inputs["num_heads"] == 1) == (case == "1 head") and not inputs["bias"]
        (inputs,) = sent[f"heads-random[{case}]"]
        assert inputs["num_heads"] == [inputs["y"].shape[1]] and (inputs["y"].shape[1] == 1) == (case == "1 head")
        assert min(inputs["x"].shape[1], inputs["y"].shape[2]) >= 2  # one token hides heads mixed with tokens
    (inputs,) = sent["gradients"]
    assert (~inputs["mask"].any(dim=-1)).any() and inputs["num_heads"] > 1


# The references' gradients through fully masked rows, against PyTorch's attention.

def torch_attention_out(q, k, v, mask):
    """The contract's output from F.scaled_dot_product_attention: a row with no key to attend is 0, and so
    is every gradient through it (it is given all keys, then multiplied by 0)."""
    attends = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~attends)
    return out * attends


@pytest.mark.parametrize("mask_shape", [(2, 1, 5, 4), (5, 4), (2, 3, 5, 4)], ids=str)
def test_reference_gradients_through_fully_masked_rows_agree_with_torch(mask_shape):
    generator = torch.Generator().manual_seed(sum(mask_shape))
    q, k = (torch.randn(2, 3, n, 6, generator=generator, dtype=torch.float64) for n in (5, 4))
    v = torch.randn(2, 3, 4, 3, generator=generator, dtype=torch.float64)
    mask = torch.rand(mask_shape, generator=generator) < 0.6
    mask[..., 0] = True
    mask.view(-1, 4)[1] = False
    dout = torch.randn(2, 3, 5, 3, generator=generator, dtype=torch.float64)
    grads = []
    for attention in (lambda *a: SDPA["scaled_dot_product_attention"](*a)[0], torch_attention_out):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (attention(*leaves, mask) * dout).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for got, expected in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (grads[0][0][0, 0, 1] == 0).all()  # batch 0, head 0, query 1 attends nothing


def test_reference_module_gradients_are_finite_through_fully_masked_rows():
    torch.manual_seed(7)
    module = MHA["MultiHeadAttention"](12, 3).double()
    query = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    key = torch.randn(2, 4, 12, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[2] = False
    out, _ = module(query, key, mask=mask)
    out.sum().backward()
    grads = [query.grad, key.grad, *(p.grad for p in module.parameters())]
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert (query.grad[:, 2] == 0).all()  # the fully masked query row gets no gradient
    module.train()
    torch.testing.assert_close(module(query, key, mask=mask)[0], module.eval()(query, key, mask=mask)[0],
                               rtol=0, atol=0)
