"""The exercises `gqa` and `kv_cache`: graded end to end, wrong answers caught, right ones in other
styles accepted, and the references checked against oracles that are not the course's code
(PyTorch's attention with `enable_gqa=True`, full causal attention, loops over heads, published sizes).

The hidden tests are parametrised by the contract's axes (layouts, biases, masks, caches,
chunkings, ...), so what a wrong answer loses does not depend on the seed: every one is graded
on several seeds and must lose exactly its tests on each.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autograde import registry as exercises
from autograde import solutions
from autograde.cases import FLOAT_DTYPES
from autograde.exercises import kv_cache as kv_cache_definition
from autograde.grading.session import catalogue, max_score
from autograde.tests import test_gqa as GQA_TESTS
from autograde.tests import test_kv_cache as KV_TESTS
from tests.fixtures.implementations import Variant, fs, variant_id
from tests.fixtures.notebooks import (
    ROOT,
    failed,
    grade_in_process,
    graded_on_seed,
    learner_notebook,
    lost,
    on_every_seed,
    replaced,
    sent_inputs,
)

pytestmark = pytest.mark.timeout(120)

GQA = solutions.namespace(exercises.get("gqa"))
KV = solutions.namespace(exercises.get("kv_cache"))
STEP = "gqa_decode_step"


# Wrong answers lose exactly the tests they break; right answers in other styles pass.

def named(test: str, *cases: str) -> frozenset[str]:
    """The report names of some cases of a parametrised test."""
    return frozenset(f"{test}[{case}]" for case in cases)


def cases(test: str, table: dict[str, tuple], keep) -> frozenset[str]:
    """The report names of the cases of a parametrised test (`table`: id -> axes) whose axes `keep` accepts."""
    return frozenset(f"{test}[{case}]" for case, axes in table.items() if keep(*axes))


def kind(layout: str) -> str:
    """"MHA", "GQA" or "MQA"."""
    return layout.split()[0]


ATTENTION, CONVERSION, DECODING = GQA_TESTS.ATTENTION_CASES, GQA_TESTS.CONVERSION_CASES, KV_TESTS.DECODING_CASES
LONG_DECODE = named("long-decode", *KV_TESTS.LONG_CACHES)
# Every decoding but the whole sequence in one step from no cache (which is causal self-attention).
AFTER_A_CACHE = cases("decoding-random", DECODING,
                      lambda layout, bias, cache, chunking, dtype: (cache, chunking) != ("no cache", "all in one step"))

WRONG = [
    Variant("repeat-instead-of-repeat-interleave", "gqa", {"repeat_kv": replaced(
        "gqa", "repeat_kv", ("x.repeat_interleave(n_rep, dim=1)", "x.repeat(1, n_rep, 1, 1)"))},
        fs("repeat-kv", "grouped-attention"),  # MHA (n_rep 1) and MQA (1 head) cannot tell
        named("repeat-kv-random", "n_rep 2 or more") | cases("attention-random", ATTENTION,
                                                              lambda layout, bias, mask, dtype: kind(layout) == "GQA")),
    Variant("causal-when-no-mask", "gqa", {"GroupedQueryAttention": replaced(
        "gqa", "GroupedQueryAttention", ("repeat_kv(v, group_size), mask)",
                                         "repeat_kv(v, group_size),\n            mask if mask is not None else "
                                         "torch.ones(length, length, dtype=torch.bool).tril())"))},
        fs(), cases("attention-random", ATTENTION, lambda layout, bias, mask, dtype: mask == "no mask")),
    Variant("two-dimensional-masks-only", "gqa", {"GroupedQueryAttention": replaced(
        "gqa", "GroupedQueryAttention", ("repeat_kv(v, group_size), mask)",
                                         "repeat_kv(v, group_size),\n            "
                                         "None if mask is None else mask.reshape(length, length))"))},
        fs(), cases("attention-random", ATTENTION,
                    lambda layout, bias, mask, dtype: mask in ("mask (B, 1, T, T)", "mask (B, H, T, T)"))),
    Variant("first-head-instead-of-mean", "gqa", {"mha_to_gqa": replaced(
        "gqa", "mha_to_gqa", ("groups.mean(dim=1)", "groups[:, 0]"))},
        fs("mha-to-gqa"), cases("mha-to-gqa-random", CONVERSION, lambda layout, bias, dtype: kind(layout) != "MHA")),
    Variant("biases-not-pooled", "gqa", {"mha_to_gqa": replaced(
        "gqa", "mha_to_gqa", ('("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")',
                              '("k_proj.weight", "v_proj.weight")'))},
        fs("mha-to-gqa"), cases("mha-to-gqa-random", CONVERSION,
                                lambda layout, bias, dtype: kind(layout) != "MHA" and bias == "with biases")),
    # Right values, but the caller's state dict is converted in place and returned.
    Variant("converts-the-callers-state-dict-in-place", "gqa", {"mha_to_gqa": replaced(
        "gqa", "mha_to_gqa", ("converted = {name: tensor.clone() for name, tensor in state_dict.items()}",
                              "converted = state_dict"))},
        named("mha-to-gqa-leaves-state-dict-unchanged", *GQA_TESTS.BIASES)),
    Variant("cache-bytes-as-float", "gqa", {"kv_cache_bytes": replaced(
        "gqa", "kv_cache_bytes", ("return 2 * num_layers", "return 2.0 * num_layers"))},
        fs("kv-cache-bytes"), named("kv-cache-bytes-random", *GQA_TESTS.ELEMENT_SIZES)),
    Variant("cache-bytes-without-factor-2", "gqa", {"kv_cache_bytes": replaced(
        "gqa", "kv_cache_bytes", ("return 2 * num_layers", "return num_layers"))},
        fs("kv-cache-bytes"), named("kv-cache-bytes-random", *GQA_TESTS.ELEMENT_SIZES)),
    Variant("bytes-per-element-ignored", "gqa", {"kv_cache_bytes": replaced(
        "gqa", "kv_cache_bytes", ("* batch_size * bytes_per_element", "* batch_size * 2"))},
        fs("kv-cache-bytes"), named("kv-cache-bytes-random", "bytes_per_element given")),
    Variant("no-value-error", "gqa", {"GroupedQueryAttention": replaced(
        "gqa", "GroupedQueryAttention", ("raise ValueError", "pass  # "))},
        fs("value-errors")),
    Variant("head-dim-as-float", "gqa", {"GroupedQueryAttention": replaced(
        "gqa", "GroupedQueryAttention", ("self.head_dim = d_model // num_heads", "self.head_dim = d_model / num_heads"),
        ("num_kv_heads * self.head_dim", "int(num_kv_heads * self.head_dim)"),
        ("self.num_heads, self.head_dim)", "self.num_heads, int(self.head_dim))"),
        ("self.num_kv_heads, self.head_dim)", "self.num_kv_heads, int(self.head_dim))"))},
        fs("module-structure")),
    Variant("top-left-causal-mask", "kv_cache", {STEP: replaced(
        "kv_cache", STEP, ("mask = torch.arange(total, device=x_new.device)[None, :] <= positions",
                           "mask = torch.ones(n, total, dtype=torch.bool, device=x_new.device).tril()"))},
        fs("token-by-token", "chunked-prefill", "given-cache"), AFTER_A_CACHE | LONG_DECODE),
    # Right for one new token (nothing to mask), top-left aligned for a chunk of several after a cache.
    Variant("top-left-causal-mask-inside-chunks", "kv_cache", {STEP: replaced(
        "kv_cache", STEP, ("mask = torch.arange(total, device=x_new.device)[None, :] <= positions",
                           "mask = torch.ones(n, total, dtype=torch.bool, device=x_new.device)\n"
                           "    if n > 1:\n        mask = mask.tril()"))},
        fs("chunked-prefill", "given-cache"), cases(
            "decoding-random", DECODING, lambda layout, bias, cache, chunking, dtype: chunking in (
                "ragged chunks", "several tokens after a first chunk") or (
                cache, chunking) == ("a given cache", "all in one step"))),
    Variant("cache-ignores-earlier-steps", "kv_cache", {STEP: replaced(
        "kv_cache", STEP, ("    if cache is not None:\n", "    new_cache = (k, v)\n    if cache is not None:\n"),
        ("return out, (k, v)", "return out, new_cache"))},
        fs("token-by-token", "chunked-prefill", "given-cache"), AFTER_A_CACHE | LONG_DECODE),
    Variant("attends-to-the-new-tokens-only", "kv_cache", {STEP: replaced(
        "kv_cache", STEP, ("    total = k.shape[2]\n", "    grown = (k, v)\n    k, v = k[:, :, -n:], v[:, :, -n:]\n"
                                                       "    total = k.shape[2]\n"),
        ("return out, (k, v)", "return out, grown"))},
        fs("token-by-token", "chunked-prefill", "given-cache"), AFTER_A_CACHE | LONG_DECODE),
    Variant("projections-without-biases", "kv_cache", {STEP: replaced(
        "kv_cache", STEP, *((f"module.{name}(x_new)", f"(x_new @ module.{name}.weight.T)")
                            for name in ("q_proj", "k_proj", "v_proj")),
        ("module.o_proj(heads.transpose(1, 2).reshape(batch, n, num_heads * head_dim))",
         "heads.transpose(1, 2).reshape(batch, n, num_heads * head_dim) @ module.o_proj.weight.T"))},
        fs("whole-prompt", "token-by-token", "chunked-prefill"),  # given-cache has no biases
        cases("decoding-random", DECODING, lambda layout, bias, cache, chunking, dtype: bias == "with biases")
        | LONG_DECODE),
    Variant("repeat-instead-of-repeat-interleave", "kv_cache", {STEP: replaced(
        "kv_cache", STEP, ("k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)",
                           "k.repeat(1, group_size, 1, 1), v.repeat(1, group_size, 1, 1)"))},
        fs("whole-prompt", "token-by-token", "chunked-prefill", "given-cache"),  # MHA and MQA cannot tell
        cases("decoding-random", DECODING, lambda layout, bias, cache, chunking, dtype: kind(layout) == "GQA")
        | LONG_DECODE),
]

GQA_HEADER = "import math\n\nimport torch\nfrom torch import nn\n\n"
RIGHT = [
    Variant("expand-einsum-over-groups-and-loops", "gqa", {
        "repeat_kv": """
def repeat_kv(x, n_rep):
    batch, heads, length, width = x.shape
    return x[:, :, None].expand(batch, heads, n_rep, length, width).reshape(batch, heads * n_rep, length, width)
""",
        "GroupedQueryAttention": GQA_HEADER + """
class GroupedQueryAttention(nn.Module):
    def __init__(self, d_model, num_heads, num_kv_heads, bias=True):
        super().__init__()
        if d_model % num_heads or num_heads % num_kv_heads:
            raise ValueError("num_heads must divide d_model and num_kv_heads must divide num_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, d_model // num_heads
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, mask=None):
        # Queries grouped as (G, r): no key or value is copied.
        B, T, _ = x.shape
        G, r, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, G, r, d)
        k, v = self.k_proj(x).view(B, T, G, d), self.v_proj(x).view(B, T, G, d)
        scores = torch.einsum("btgrd,bsgd->bgrts", q, k) / math.sqrt(d)
        if mask is not None:
            grouped = torch.broadcast_to(mask, (B, G * r, T, T)).reshape(B, G, r, T, T)
            scores = scores.masked_fill(~grouped, float("-inf"))
        weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        return self.o_proj(torch.einsum("bgrts,bsgd->btgrd", weights, v).reshape(B, T, G * r * d))
""",
        "mha_to_gqa": """
def mha_to_gqa(state_dict, num_heads, num_kv_heads):
    result = dict(state_dict)
    head_dim = state_dict["q_proj.weight"].shape[1] // num_heads
    group = num_heads // num_kv_heads
    for key in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        if key in state_dict:
            heads = state_dict[key].split(head_dim)
            result[key] = torch.cat([sum(heads[g * group:(g + 1) * group]) / group for g in range(num_kv_heads)])
    return result
""",
        "kv_cache_bytes": """
def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element=2):
    return math.prod([2, num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element])
"""}),
    Variant("einsum-over-groups-and-explicit-softmax", "kv_cache", {STEP: """
import math

import torch


def gqa_decode_step(module, x_new, cache=None):
    B, n, _ = x_new.shape
    G, d = module.num_kv_heads, module.head_dim
    r = module.num_heads // G
    q = module.q_proj(x_new).view(B, n, G, r, d)
    k = module.k_proj(x_new).view(B, n, G, d).permute(0, 2, 1, 3)
    v = module.v_proj(x_new).view(B, n, G, d).permute(0, 2, 1, 3)
    if cache is not None:
        k, v = torch.cat((cache[0], k), dim=-2), torch.cat((cache[1], v), dim=-2)
    t = k.shape[-2] - n
    scores = torch.einsum("bngrd,bgsd->bgrns", q, k) * d ** -0.5
    allowed = torch.ones(n, t + n, dtype=torch.bool, device=x_new.device).tril(diagonal=t)
    scores = scores.masked_fill(~allowed, -math.inf)
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("bgrns,bgsd->bngrd", weights, v).reshape(B, n, G * r * d)
    return module.o_proj(out), (k, v)
"""}),
]



@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", WRONG, ids=variant_id)
@on_every_seed()
def test_a_wrong_answer_loses_exactly_its_tests_on_every_seed(variant, seed):
    assert not variant.hidden_may_fail  # the parameters, not the seed, decide what a wrong answer loses
    names = {test.name for test in catalogue(exercises.get(variant.exercise))}
    assert variant.visible_failures | variant.hidden_failures <= names  # the names of tests that exist
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    visible, hidden = lost(results)
    assert (seed, visible) == (seed, variant.visible_failures)
    assert (seed, hidden) == (seed, variant.hidden_failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", RIGHT, ids=variant_id)
@on_every_seed()
def test_a_right_answer_in_another_style_passes_every_test_on_every_seed(variant, seed):
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    assert (seed, failed(results)) == (seed, set())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exercise_id", ["gqa", "kv_cache"])
@on_every_seed()
def test_the_solution_keeps_full_marks_on_every_seed(exercise_id, seed):
    assert max_score(exercises.get(exercise_id)) == 10
    results = graded_on_seed(exercise_id, None, seed)
    assert (seed, failed(results)) == (seed, set())
    assert sum(result.points for result in results.values()) == 10


def test_torch_attention_with_enable_gqa_is_not_allowed():
    step = replaced("kv_cache", STEP, ("    heads = torch.softmax(scores, dim=-1) @ values\n",
                                       "    heads = torch.nn.functional.scaled_dot_product_attention(\n"
                                       "        q, k, v, attn_mask=mask, enable_gqa=True)\n"))
    _, violations = grade_in_process("kv_cache", learner_notebook("kv_cache", {STEP: step}))
    assert {v.name for v in violations} == {"torch.nn.functional.scaled_dot_product_attention"}


FEEDBACK = [
    ("cache-ignores-earlier-steps", "token-by-token",
     "gqa_decode_step(module, x[:, 1:2], cache) returned a cache tensor of shape (2, 2, 1, 4); expected (2, 2, 2, 4)"),
    ("top-left-causal-mask-inside-chunks", "chunked-prefill", "`chunks 3+4: out`: max abs error"),
    ("cache-bytes-without-factor-2", "kv-cache-bytes",
     "`kv_cache_bytes(32, 32, 128, 4096, 1)`: expected 2147483648, got 1073741824"),
    ("head-dim-as-float", "module-structure",
     "`GroupedQueryAttention(16, 4, 2, bias=True).head_dim`: expected an int, 4; got the float 4.0"),
    ("cache-bytes-as-float", "kv-cache-bytes",
     "`kv_cache_bytes(32, 32, 128, 4096, 1)`: expected an int, 2147483648; got the float 2147483648.0"),
    ("converts-the-callers-state-dict-in-place", "mha-to-gqa-leaves-state-dict-unchanged[with biases]",
     "`mha_to_gqa(state_dict, 4, 2) returns a new dict`: expected True, got False"),
    ("converts-the-callers-state-dict-in-place", "mha-to-gqa-leaves-state-dict-unchanged[without biases]",
     "`mha_to_gqa(state_dict, 4, 2) leaves state_dict unchanged`: expected True, got False"),
    ("bytes-per-element-ignored", "kv-cache-bytes",
     "`kv_cache_bytes(80, 8, 128, 4096, 8, bytes_per_element=4)`: expected 21474836480, got 10737418240"),
]


@pytest.mark.parametrize("name, case, message", FEEDBACK, ids=[f[0] for f in FEEDBACK])
def test_feedback_says_precisely_what_is_wrong(name, case, message):
    variant = next(v for v in WRONG if v.name == name)
    results, _ = grade_in_process(variant.exercise, learner_notebook(variant.exercise, variant.answers))
    assert any(problem.startswith(message) for problem in results[case].problems), results[case].problems


@pytest.mark.timeout(300)
@on_every_seed()
def test_a_byte_count_returned_as_a_float_is_told_to_be_an_int_in_every_test(seed):
    """Every value kv_cache_bytes returns as a float, visible or hidden, is reported as "expected an int"."""
    variant = next(v for v in WRONG if v.name == "cache-bytes-as-float")
    results = graded_on_seed(variant.exercise, variant.answers, seed)
    for name in variant.visible_failures | variant.hidden_failures:
        problems = results[name].problems
        assert problems and all(re.fullmatch(r"`kv_cache_bytes\(.*\)`: expected an int, (\d+); got the float \1\.0",
                                             problem) for problem in problems), (seed, problems)


def test_the_step_is_given_only_the_attributes_of_the_contract():
    """A step that calls methods of the learner's own module (not in the contract) fails every test."""
    step = "def gqa_decode_step(module, x_new, cache=None):\n    return module(x_new), cache\n"
    results, _ = grade_in_process("kv_cache", learner_notebook("kv_cache", {STEP: step}))
    assert failed(results) == set(results)
    given_module = kv_cache_definition.given_module
    module = given_module(sent_inputs("kv_cache", None)["given-cache"][0])
    assert sorted(vars(module)) == ["head_dim", "k_proj", "num_heads", "num_kv_heads", "o_proj", "q_proj", "v_proj"]
    assert (module.k_proj.in_features, module.k_proj.out_features, module.k_proj.bias) == (12, 6, None)


# The references against independent oracles.

def seeded_gqa(d_model, num_heads, num_kv_heads, bias, dtype, seed):
    torch.manual_seed(seed)
    module = GQA["GroupedQueryAttention"](d_model, num_heads, num_kv_heads, bias=bias).to(dtype)
    if bias:  # nn.Linear's biases are small; larger ones show a bias applied in the wrong place
        with torch.no_grad():
            for layer in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
                layer.bias.normal_()
    return module


def torch_gqa(module, x, mask=None, is_causal=False):
    """The module's function computed by PyTorch's attention, which maps query heads to key/value heads itself."""
    B, T, d_model = x.shape
    q = module.q_proj(x).view(B, T, module.num_heads, -1).transpose(1, 2)
    k = module.k_proj(x).view(B, T, module.num_kv_heads, -1).transpose(1, 2)
    v = module.v_proj(x).view(B, T, module.num_kv_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return module.o_proj(out.transpose(1, 2).reshape(B, T, d_model))


GQA_CASES = [
    # d_model, heads, kv heads, bias, batch, T, mask: None, "causal" or "random" (B, H, T, T)
    (16, 4, 2, True, 2, 5, "causal"),
    (24, 8, 2, False, 3, 6, "random"),
    (24, 6, 3, True, 2, 4, None),
    (16, 4, 4, True, 2, 5, "random"),  # MHA
    (32, 8, 1, False, 2, 7, "causal"),  # MQA
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("d_model, heads, kv_heads, bias, B, T, mask_kind", GQA_CASES)
def test_reference_module_agrees_with_torch_sdpa_enable_gqa(d_model, heads, kv_heads, bias, B, T, mask_kind, dtype):
    module = seeded_gqa(d_model, heads, kv_heads, bias, dtype, seed=heads * 10 + kv_heads)
    assert (module.num_heads, module.num_kv_heads, module.head_dim) == (heads, kv_heads, d_model // heads)
    x = torch.randn(B, T, d_model, dtype=dtype)
    mask = {None: None, "causal": torch.ones(T, T, dtype=torch.bool).tril(),
            "random": torch.rand(B, heads, T, T) < 0.6}[mask_kind]
    if mask_kind == "random":
        mask[..., 0] = True  # no row without a key: PyTorch gives NaN there, the contract 0
    with torch.no_grad():
        torch.testing.assert_close(module(x, mask=mask), torch_gqa(module, x, mask))


def test_reference_repeat_kv_maps_query_head_i_to_kv_head_i_over_r():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    for n_rep in (1, 2, 4):
        expected = x.index_select(1, torch.arange(3 * n_rep) // n_rep)
        assert torch.equal(GQA["repeat_kv"](x, n_rep), expected)


def test_reference_module_raises_value_error_and_has_the_contract_shapes():
    for bad in ((10, 4, 2), (16, 4, 3), (16, 4, 8)):
        with pytest.raises(ValueError):
            GQA["GroupedQueryAttention"](*bad)
    module = GQA["GroupedQueryAttention"](64, 8, 2, bias=False)
    shapes = {name: (layer.in_features, layer.out_features, layer.bias is None)
              for name, layer in module.named_children()}
    assert shapes == {"q_proj": (64, 64, True), "k_proj": (64, 16, True), "v_proj": (64, 16, True),
                      "o_proj": (64, 64, True)}


def pooled_by_loops(tensor, num_heads, num_kv_heads):
    """Mean of each group's heads, one head at a time."""
    head_dim, group = tensor.shape[0] // num_heads, num_heads // num_kv_heads
    heads = [tensor[i * head_dim:(i + 1) * head_dim] for i in range(num_heads)]
    return torch.cat([torch.stack(heads[g * group:(g + 1) * group]).mean(dim=0) for g in range(num_kv_heads)])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (8, 1), (6, 3), (4, 4)])
def test_reference_mha_to_gqa_pools_each_group_and_loads(heads, kv_heads, bias):
    mha = seeded_gqa(8 * heads, heads, heads, bias, torch.float64, seed=heads)
    state = mha.state_dict()
    converted = GQA["mha_to_gqa"](state, heads, kv_heads)
    assert set(converted) == set(state)
    for name, tensor in state.items():
        expected = pooled_by_loops(tensor, heads, kv_heads) if name.startswith(("k_proj", "v_proj")) else tensor
        torch.testing.assert_close(converted[name], expected, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(tensor, mha.state_dict()[name]) for name, tensor in state.items())  # left unchanged
    gqa = GQA["GroupedQueryAttention"](8 * heads, heads, kv_heads, bias=bias).double()
    gqa.load_state_dict(converted)


def test_reference_mha_to_gqa_is_exact_when_the_heads_of_each_group_agree():
    """Duplicate each group's key and value heads in an MHA layer: the converted GQA layer computes the same."""
    d_model, heads, kv_heads = 32, 8, 2
    gqa = seeded_gqa(d_model, heads, kv_heads, True, torch.float64, seed=3)
    mha = GQA["GroupedQueryAttention"](d_model, heads, heads).double()
    state = dict(gqa.state_dict())
    for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        state[name] = GQA["repeat_kv"](state[name].reshape(1, kv_heads, d_model // heads, -1), heads // kv_heads
                                       ).reshape(d_model, *state[name].shape[1:])
    mha.load_state_dict(state)
    converted = GQA["GroupedQueryAttention"](d_model, heads, kv_heads).double()
    converted.load_state_dict(GQA["mha_to_gqa"](mha.state_dict(), heads, kv_heads))
    x = torch.randn(2, 6, d_model, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), mha(x))
        torch.testing.assert_close(converted(x), gqa(x))


def test_reference_kv_cache_bytes_matches_published_sizes():
    size = GQA["kv_cache_bytes"]
    assert size(32, 32, 128, 1, 1) == 512 * 2**10  # LLaMA-2 7B: 0.5 MiB per token in float16
    assert size(80, 8, 128, 1, 1) == 320 * 2**10  # LLaMA-2 70B with 8 key/value heads
    assert size(32, 32, 128, 4096, 8) == 16 * 2**30
    assert size(32, 32, 128, 4096, 1, bytes_per_element=4) == 2 * size(32, 32, 128, 4096, 1)
    assert isinstance(size(1, 1, 1, 1, 1), int)


def decode_in_chunks(module, x, sizes, cache=None):
    outputs, start = [], 0
    for size in sizes:
        out, cache = KV[STEP](module, x[:, start:start + size], cache)
        outputs.append(out)
        start += size
    return torch.cat(outputs, dim=1), cache


CHUNKINGS = [[12], [1] * 12, [5, 1, 1, 1, 1, 1, 1, 1], [4, 4, 4], [3, 1, 5, 2, 1], [1, 11]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("heads, kv_heads, bias", [(8, 2, True), (4, 4, False), (8, 1, True), (6, 3, False)])
def test_reference_decoding_in_any_chunking_is_full_causal_attention(heads, kv_heads, bias, dtype):
    module = seeded_gqa(8 * heads, heads, kv_heads, bias, dtype, seed=heads + kv_heads)
    given = SimpleNamespace(**{name: getattr(module, name) for name in (
        "q_proj", "k_proj", "v_proj", "o_proj", "num_heads", "num_kv_heads", "head_dim")})
    x = torch.randn(2, 12, 8 * heads, dtype=dtype)
    with torch.no_grad():
        full = torch_gqa(module, x, is_causal=True)
        keys = module.k_proj(x).view(2, 12, kv_heads, 8).transpose(1, 2)
        values = module.v_proj(x).view(2, 12, kv_heads, 8).transpose(1, 2)
        for sizes in CHUNKINGS:
            out, (k, v) = decode_in_chunks(given, x, sizes)
            assert out.dtype == k.dtype == dtype
            torch.testing.assert_close(out, full)
            torch.testing.assert_close(k, keys)
            torch.testing.assert_close(v, values)


def test_reference_step_after_a_given_cache_uses_the_bottom_right_mask():
    module = seeded_gqa(24, 6, 3, True, torch.float64, seed=5)
    cache = (torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64))
    x_new = torch.randn(2, 3, 24, dtype=torch.float64)
    with torch.no_grad():
        out, (k, v) = KV[STEP](module, x_new, cache)
        q = module.q_proj(x_new).view(2, 3, 6, 4).transpose(1, 2)
        assert torch.equal(k[:, :, :4], cache[0]) and torch.equal(v[:, :, :4], cache[1])
        mask = torch.tensor([[j <= 4 + i for j in range(7)] for i in range(3)])
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, module.o_proj(expected.transpose(1, 2).reshape(2, 3, 24)))


@pytest.mark.timeout(300)
@on_every_seed(tuple(range(10)))
def test_the_hidden_inputs_of_gqa_are_what_their_case_names_say(seed):
    layouts = {"MHA": lambda heads, kv_heads: kv_heads == heads > 1,
               "MQA": lambda heads, kv_heads: kv_heads == 1 < heads,
               "GQA": lambda heads, kv_heads: 1 < kv_heads < heads and heads % kv_heads == 0}
    sent = sent_inputs("gqa", seed)
    for case, (layout, bias, mask, dtype) in ATTENTION.items():
        (inputs,) = sent[f"attention-random[{case}]"]
        B, T, _ = inputs["x"].shape
        assert layouts[kind(layout)](inputs["num_heads"], inputs["num_kv_heads"])
        assert inputs["bias"] == GQA_TESTS.BIASES[bias] == ("q_proj.bias" in inputs.values)
        shapes = {"no mask": None, "mask (T, T)": (T, T), "mask (B, 1, T, T)": (B, 1, T, T),
                  "mask (B, H, T, T)": (B, inputs["num_heads"], T, T)}
        assert (None if inputs.get("mask") is None else tuple(inputs["mask"].shape)) == shapes[mask]
        assert B > 1 and T > 1  # (B, 1, T, T) is not (T, T), and no mask is not a causal one
        assert inputs["x"].dtype == FLOAT_DTYPES[dtype]
    for case, (layout, bias, dtype) in CONVERSION.items():
        (inputs,) = sent[f"mha-to-gqa-random[{case}]"]
        assert layouts[kind(layout)](inputs["num_heads"], *inputs["num_kv_heads"])
        assert ("k_proj.bias" in inputs.values) == GQA_TESTS.BIASES[bias]
        assert inputs["q_proj.weight"].dtype == FLOAT_DTYPES[dtype]
    for case in GQA_TESTS.REPEATS:
        (inputs,) = sent[f"repeat-kv-random[{case}]"]
        assert {n_rep for _, n_rep in inputs["calls"]} <= ({1} if case == "n_rep 1" else {2, 3, 4})
        assert inputs["x"].shape[1] > 1 and inputs["one_head"].shape[1] == 1
    for case in GQA_TESTS.ELEMENT_SIZES:
        (inputs,) = sent[f"kv-cache-bytes-random[{case}]"]
        given = [size for _, size in inputs["calls"]]
        assert given == ([None] * 3 if case == "bytes_per_element by default" else [1, 2, 4])


@pytest.mark.timeout(300)
@on_every_seed(tuple(range(10)))
def test_the_hidden_inputs_of_kv_cache_are_what_their_case_names_say(seed):
    sent = sent_inputs("kv_cache", seed)
    for case, (layout, bias, cache, chunking, dtype) in DECODING.items():
        (inputs,) = sent[f"decoding-random[{case}]"]
        heads, kv_heads = inputs["num_heads"], inputs["num_kv_heads"]
        assert {"MHA": kv_heads == heads > 1, "MQA": kv_heads == 1 < heads,
                "GQA": 1 < kv_heads < heads}[kind(layout)]
        assert ("q_proj.bias" in inputs.values) == GQA_TESTS.BIASES[bias]
        assert ("cache_k" in inputs.values) == (cache == "a given cache")
        if cache == "a given cache":
            assert inputs["cache_k"].shape[2] >= 1
        (sizes,) = inputs["chunkings"]
        assert sum(sizes) == inputs["x"].shape[1] and min(sizes) >= 1
        assert {"all in one step": len(sizes) == 1, "token by token": set(sizes) == {1},
                "ragged chunks": len(sizes) > 2 and max(sizes[1:]) > 1,
                "several tokens after a first chunk": len(sizes) == 2 and sizes[1] > 1}[chunking]
        assert inputs["x"].dtype == FLOAT_DTYPES[dtype]
    for case in KV_TESTS.LONG_CACHES:
        (inputs,) = sent[f"long-decode[{case}]"]
        assert ("cache_k" in inputs.values) == (case != "no cache")
        assert "cache_k" not in inputs.values or inputs["cache_k"].shape[2] == 0


# The notebooks.

def source_notebook(exercise_id: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / exercises.get(exercise_id).notebook, as_version=4)


@pytest.mark.parametrize("exercise_id, pages", [("gqa", {"mqa-gqa", "mha-to-gqa", "kv-cache"}),
                                                ("kv_cache", {"kv-cache", "mqa-gqa"})])
def test_the_notebooks_link_their_chapters_and_import_no_other_notebook(exercise_id, pages):
    notebook = source_notebook(exercise_id)
    prose = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert set(re.findall(r"https://mha-derived\.github\.io/mha-derived/book/([a-z0-9-]+)\.html", prose)) == pages
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert not re.search(r"import (sdpa|mha|gqa)|from (sdpa|mha|gqa) |%run|import_ipynb|\.ipynb", code)


def test_the_kv_cache_answer_defines_its_own_attention():
    """One solution cell, which runs alone: it uses nothing from the gqa notebook."""
    cells = [c for c in source_notebook("kv_cache").cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    assert len(cells) == 1
    names: dict = {}
    exec(cells[0].source, names)
    module = SimpleNamespace(q_proj=nn.Linear(8, 8), k_proj=nn.Linear(8, 4), v_proj=nn.Linear(8, 4),
                             o_proj=nn.Linear(8, 8), num_heads=4, num_kv_heads=2, head_dim=2)
    out, (k, v) = names[STEP](module, torch.randn(1, 3, 8))
    assert out.shape == (1, 3, 8) and k.shape == v.shape == (1, 2, 3, 2)
    assert math.isfinite(out.abs().sum().item())
