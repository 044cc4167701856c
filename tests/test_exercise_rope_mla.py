"""The exercises `rope` and `mla`: graded end to end, wrong answers caught (on several seeds), right ones in
other styles accepted, and the references checked against oracles that are not the course's code: RoPE as
complex multiplication (`torch.view_as_complex`), PyTorch's attention on the rotated heads, MLA with every
head's keys and values materialised from the latent (no absorption), and the cache sizes of the papers.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import nbformat
import pytest
import torch
import torch.nn.functional as F

from autograde import registry as exercises
from autograde import solutions
from autograde.cases import Inputs
from autograde.exercises import mla as mla_definition
from autograde.exercises import rope as rope_definition
from autograde.frontends import check as self_check
from autograde.frontends.nbgrader import test_function as function_of_test
from autograde.grading.session import catalogue
from autograde.rules import measure
from autograde.submission import extract
from autograde.tests import test_mla as MLA_TESTS
from tests.fixtures.implementations import Variant, fs, variant_id
from tests.fixtures.notebooks import (
    ROOT,
    assert_loses_exactly,
    failed,
    grade_in_process,
    learner_notebook,
    on_every_seed,
    replaced,
    sent_inputs,
)

pytestmark = pytest.mark.timeout(300)

ROPE = solutions.namespace(exercises.get("rope"))
MLA = solutions.namespace(exercises.get("mla"))
SEEDS = (1, 2, 3, 5, 8, 13)  # the seeds on which every wrong answer must lose exactly its hidden tests


# Wrong answers lose exactly the tests they break; right answers in other styles pass.

ROPE_CELL, ROTARY, ROPE_STEP = "apply_rope", "RotaryGroupedQueryAttention", "rope_decode_step"
POSITIONS = fs(*(f"rope-position-shapes[positions {shape}]" for shape in ("(T,)", "(B, 1, T)", "(B, H, T)")))
ROTATIONS = fs("rope-halves", "rope-interleaved") | POSITIONS
ROTATIONS_HIDDEN = fs("rope-random[halves]", "rope-random[interleaved]")
ATTENTION = fs(*(f"rotary-attention[{case}]" for case in ("MQA, default base", "GQA, base 500", "MHA, base 100")))
DECODE = fs("decode-token-by-token", "decode-chunked-prefill", "decode-given-cache[empty cache (t = 0)]",
            "decode-given-cache[cache of 4 tokens]")
DECODE_HIDDEN = fs("decode-random", "decode-long")
ROTATE_K = "k = apply_rope(k, positions, base=module.rope_base)  # rotated once, before it is cached\n"
READ_K = "k.repeat_interleave(group_size, dim=1)"

ROPE_WRONG = [
    Variant("pairs-of-the-other-layout", "rope", {ROPE_CELL: replaced(
        "rope", ROPE_CELL, ("if interleaved:", "if not interleaved:"))},
        ROTATIONS | ATTENTION | DECODE, ROTATIONS_HIDDEN | fs("rotary-attention-random") | DECODE_HIDDEN),
    Variant("no-value-error-for-an-odd-width", "rope", {ROPE_CELL: replaced(
        "rope", ROPE_CELL, ('        raise ValueError(f"apply_rope needs an even last dimension; x has {d}")\n',
                            "        pass\n"))},
        fs("rope-odd-width")),
    Variant("positions-taken-as-one-dimensional", "rope", {ROPE_CELL: replaced(
        "rope", ROPE_CELL, ("positions.to(device=x.device, dtype=x.dtype)[..., None]",
                            "positions.to(device=x.device, dtype=x.dtype).reshape(-1, 1)"))},
        POSITIONS - fs("rope-position-shapes[positions (T,)]"), hidden_may_fail=ROTATIONS_HIDDEN),
    Variant("module-rotates-interleaved-pairs", "rope", {ROTARY: replaced(
        "rope", ROTARY, ("base=self.rope_base)", "base=self.rope_base, interleaved=True)"))},
        ATTENTION, fs("rotary-attention-random")),
    Variant("values-rotated", "rope", {ROTARY: replaced(
        "rope", ROTARY, ("        group_size =", "        v = apply_rope(v, positions, base=self.rope_base)\n"
                                                "        group_size ="))},
        ATTENTION, fs("rotary-attention-random")),
    Variant("module-ignores-rope-base", "rope", {ROTARY: replaced(
        "rope", ROTARY, ("base=self.rope_base", "base=10000.0"))},
        fs("rotary-attention[GQA, base 500]", "rotary-attention[MHA, base 100]"),
        hidden_may_fail=fs("rotary-attention-random")),
    Variant("positions-not-offset-by-the-cache", "rope", {ROPE_STEP: replaced(
        "rope", ROPE_STEP, ("apply_rope(q, positions,", "apply_rope(q, positions - cached,"),
        ("apply_rope(k, positions,", "apply_rope(k, positions - cached,"))},
        DECODE - fs("decode-given-cache[empty cache (t = 0)]"), DECODE_HIDDEN),
    Variant("values-rotated-in-decoding", "rope", {ROPE_STEP: replaced(
        "rope", ROPE_STEP, (ROTATE_K, ROTATE_K + "    v = apply_rope(v, positions, base=module.rope_base)\n"))},
        DECODE, DECODE_HIDDEN),
    # Rotated before caching, and again, at every position, when the cache is read.
    Variant("keys-rotated-twice", "rope", {ROPE_STEP: replaced(
        "rope", ROPE_STEP, (READ_K, "apply_rope(k, torch.arange(cached + n), base=module.rope_base)"
                                    ".repeat_interleave(group_size, dim=1)"))},
        DECODE, DECODE_HIDDEN),
    # Right outputs, but the cache holds keys before rotation (rotated when read): not the contract's cache.
    Variant("cache-of-unrotated-keys", "rope", {ROPE_STEP: replaced(
        "rope", ROPE_STEP, ("    " + ROTATE_K, ""),
        (READ_K, "apply_rope(k, torch.arange(cached + n), base=module.rope_base)"
                 ".repeat_interleave(group_size, dim=1)"))},
        DECODE, DECODE_HIDDEN),
    Variant("decoding-ignores-rope-base", "rope", {ROPE_STEP: replaced(
        "rope", ROPE_STEP, ("base=module.rope_base", "base=10000.0"))},
        DECODE - fs("decode-token-by-token"), hidden_may_fail=DECODE_HIDDEN),
]

MLA_MODULE, MLA_STEP, MLA_BYTES = "MultiHeadLatentAttention", "mla_decode_step", "mla_cache_bytes"
LATENT_DECODE = fs("decode-token-by-token", "decode-chunked-prefill[rope_dim > 0]",
                   "decode-chunked-prefill[rope_dim 0]", "decode-given-cache[empty cache (t = 0)]",
                   "decode-given-cache[cache of 5 tokens]")
ROTARY_DECODE = LATENT_DECODE - fs("decode-chunked-prefill[rope_dim 0]")
MEMORY = fs("memory-rule")

EXPANDED_STEP = '''
import math

import torch


def mla_decode_step(module, x_new, cache=None):
    """Right values, but every head's keys and values are rebuilt from the whole cached latent at each step."""
    batch, n, _ = x_new.shape
    heads, width, rotary = module.num_heads, module.head_dim, module.rope_dim
    cached = 0 if cache is None else cache[0].shape[1]
    positions = torch.arange(cached, cached + n)
    q = module.q_proj(x_new).reshape(batch, n, heads, width + rotary)
    latent = module.kv_down(x_new)
    if rotary > 0:
        rope_keys = apply_rope(module.k_rope(x_new), positions, base=module.rope_base)
        q_rotary = apply_rope(q[..., width:], positions[:, None], base=module.rope_base)
    else:
        rope_keys, q_rotary = x_new.new_zeros(batch, n, 0), q[..., width:]
    if cache is not None:
        latent, rope_keys = torch.cat([cache[0], latent], dim=1), torch.cat([cache[1], rope_keys], dim=1)
    total = cached + n
    k = module.k_up(latent).reshape(batch, total, heads, width)
    v = module.v_up(latent).reshape(batch, total, heads, width)
    scores = torch.einsum("bnhd,bshd->bnhs", q[..., :width], k) + torch.einsum("bnhr,bsr->bnhs", q_rotary, rope_keys)
    mask = torch.arange(total)[None, :] <= positions[:, None]
    scores = (scores / math.sqrt(width + rotary)).masked_fill(~mask[:, None, :], float("-inf"))
    out = torch.einsum("bnhs,bshd->bnhd", torch.softmax(scores, dim=-1), v)
    return module.o_proj(out.reshape(batch, n, heads * width)), (latent, rope_keys)
'''

# Every head's keys and values rebuilt from the latent, sixteen cached tokens at a time: no tensor is
# large, and the values are right; only the work shows it (issue of a red team: expansion in pieces).
EXPANDED_IN_PIECES_STEP = EXPANDED_STEP.replace(
    "    k = module.k_up(latent).reshape(batch, total, heads, width)\n"
    "    v = module.v_up(latent).reshape(batch, total, heads, width)\n"
    "    scores = torch.einsum(\"bnhd,bshd->bnhs\", q[..., :width], k) + "
    "torch.einsum(\"bnhr,bsr->bnhs\", q_rotary, rope_keys)\n",
    "    pieces = [(module.k_up(latent[:, s:s + 16]).reshape(batch, -1, heads, width),\n"
    "               module.v_up(latent[:, s:s + 16]).reshape(batch, -1, heads, width)) for s in range(0, total, 16)]\n"
    "    scores = torch.cat([torch.einsum(\"bnhd,bshd->bnhs\", q[..., :width], k) for k, _ in pieces], dim=-1)\n"
    "    scores = scores + torch.einsum(\"bnhr,bsr->bnhs\", q_rotary, rope_keys)\n").replace(
    "    out = torch.einsum(\"bnhs,bshd->bnhd\", torch.softmax(scores, dim=-1), v)\n",
    "    weights = torch.softmax(scores, dim=-1)\n"
    "    out = sum(torch.einsum(\"bnhs,bshd->bnhd\", weights[..., 16 * i:16 * i + v.shape[1]], v)\n"
    "              for i, (_, v) in enumerate(pieces))\n")

# As a learner caches for GQA: the keys (content and rotary parts) and values of every head.
PER_HEAD_CACHE_STEP = '''
import math

import torch


def mla_decode_step(module, x_new, cache=None):
    batch, n, _ = x_new.shape
    heads, width, rotary = module.num_heads, module.head_dim, module.rope_dim
    cached = 0 if cache is None else cache[0].shape[2]
    positions = torch.arange(cached, cached + n)
    q = module.q_proj(x_new).reshape(batch, n, heads, width + rotary).transpose(1, 2)
    latent = module.kv_down(x_new)
    k = module.k_up(latent).reshape(batch, n, heads, width).transpose(1, 2)
    v = module.v_up(latent).reshape(batch, n, heads, width).transpose(1, 2)
    if rotary > 0:
        q = torch.cat([q[..., :width], apply_rope(q[..., width:], positions, base=module.rope_base)], dim=-1)
        k_rotary = apply_rope(module.k_rope(x_new), positions, base=module.rope_base)
        k = torch.cat([k, k_rotary[:, None].expand(batch, heads, n, rotary)], dim=-1)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    mask = torch.arange(cached + n)[None, :] <= positions[:, None]
    scores = (q @ k.transpose(-2, -1) / math.sqrt(width + rotary)).masked_fill(~mask, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, n, heads * width)
    return module.o_proj(out), (k, v)
'''

MLA_WRONG = [
    Variant("scale-without-rope-dim", "mla", {MLA_MODULE: replaced(
        "mla", MLA_MODULE, ("math.sqrt(width + rotary)", "math.sqrt(width)"))},
        fs("latent-attention[rope_dim > 0]"), fs("latent-attention-random[rope_dim > 0]")),
    Variant("scale-without-rope-dim-in-decoding", "mla", {MLA_STEP: replaced(
        "mla", MLA_STEP, ("math.sqrt(width + rotary)", "math.sqrt(width)"))},
        ROTARY_DECODE, fs("decode-random[rope_dim > 0]")),
    Variant("a-rotary-key-per-head", "mla", {MLA_MODULE: replaced(
        "mla", MLA_MODULE, ("nn.Linear(d_model, rope_dim, bias=False)",
                            "nn.Linear(d_model, num_heads * rope_dim, bias=False)"),
        ("apply_rope(self.k_rope(x), positions,",
         "apply_rope(self.k_rope(x).reshape(batch, length, heads, rotary).transpose(1, 2), positions,"),
        ("k_rotary[:, None].transpose(-2, -1)", "k_rotary.transpose(-2, -1)"))},
        fs("module-structure[rope_dim > 0]", "latent-attention[rope_dim > 0]"),
        fs("latent-attention-random[rope_dim > 0]")),
    Variant("positions-not-offset-by-the-cache", "mla", {MLA_STEP: replaced(
        "mla", MLA_STEP, ("apply_rope(module.k_rope(x_new), positions,",
                          "apply_rope(module.k_rope(x_new), positions - cached,"),
        ("apply_rope(q_rotary, positions[:, None],", "apply_rope(q_rotary, (positions - cached)[:, None],"))},
        ROTARY_DECODE - fs("decode-given-cache[empty cache (t = 0)]"), fs("decode-random[rope_dim > 0]")),
    # Values right, memory not: the rule is the only test it fails.
    Variant("latent-expanded-into-per-head-keys", "mla", {MLA_STEP: EXPANDED_STEP},
            MEMORY, fs("memory-rule-random")),
    Variant("latent-expanded-in-pieces", "mla", {MLA_STEP: EXPANDED_IN_PIECES_STEP},
            MEMORY, fs("memory-rule-random")),
    Variant("latent-broadcast-over-the-heads", "mla", {MLA_STEP: replaced(
        "mla", MLA_STEP,
        ("    q_latent = torch.einsum(\"bnhd,hdc->bnhc\", q_content, w_uk).reshape(batch, n * heads, latent_dim)\n"
         "    scores = q_latent @ latent.transpose(1, 2)",
         "    q_latent = torch.einsum(\"bnhd,hdc->bnhc\", q_content, w_uk).transpose(1, 2)  # (B, H, n, d_c)\n"
         "    scores = (q_latent @ latent[:, None].transpose(-2, -1))"
         ".transpose(1, 2).reshape(batch, n * heads, total)"))},
        MEMORY, fs("memory-rule-random")),
    Variant("cache-of-per-head-keys-and-values", "mla", {MLA_STEP: PER_HEAD_CACHE_STEP},
            LATENT_DECODE | MEMORY,
            fs("decode-random[rope_dim > 0]", "decode-random[rope_dim 0]", "memory-rule-random")),
    Variant("cache-bytes-without-the-rotary-keys", "mla", {MLA_BYTES: replaced(
        "mla", MLA_BYTES, ("(kv_latent_dim + rope_dim)", "kv_latent_dim"))},
        fs("cache-bytes"), fs("cache-bytes-random")),
]

WRONG = ROPE_WRONG + MLA_WRONG

RIGHT = [
    Variant("complex-numbers-grouped-einsum-and-tril", "rope", {
        ROPE_CELL: '''
import torch


def apply_rope(x, positions, base=10000.0, interleaved=False):
    d = x.shape[-1]
    if d % 2:
        raise ValueError("the last dimension must be even")
    angles = positions.double()[..., None] / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones_like(angles), angles)
    wide = x.double()
    if interleaved:
        rotated = torch.view_as_complex(wide.unflatten(-1, (d // 2, 2)).contiguous()) * turn
        return torch.view_as_real(rotated).flatten(-2).to(x.dtype)
    rotated = torch.complex(wide[..., : d // 2], wide[..., d // 2:]) * turn
    return torch.cat([rotated.real, rotated.imag], dim=-1).to(x.dtype)
''',
        ROTARY: '''
import math

import torch
from torch import nn


class RotaryGroupedQueryAttention(nn.Module):
    def __init__(self, d_model, num_heads, num_kv_heads, bias=True, rope_base=10000.0):
        super().__init__()
        if d_model % num_heads or num_heads % num_kv_heads:
            raise ValueError("num_heads must divide d_model and num_kv_heads must divide num_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, d_model // num_heads
        self.rope_base = float(rope_base)
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        G, r, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        where = torch.arange(T)
        # (B, T, heads, d) with positions (T, 1): the token axis is not second to last here
        q = apply_rope(self.q_proj(x).view(B, T, G * r, d), where[:, None], self.rope_base).view(B, T, G, r, d)
        k = apply_rope(self.k_proj(x).view(B, T, G, d), where[:, None], self.rope_base)
        v = self.v_proj(x).view(B, T, G, d)
        scores = torch.einsum("btgrd,bsgd->bgrts", q, k) / math.sqrt(d)
        if mask is not None:
            scores = scores.masked_fill(~torch.broadcast_to(mask, (B, G * r, T, T)).reshape(B, G, r, T, T), -math.inf)
        weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        return self.o_proj(torch.einsum("bgrts,bsgd->btgrd", weights, v).reshape(B, T, G * r * d))
''',
        ROPE_STEP: '''
import math

import torch


def rope_decode_step(module, x_new, cache=None):
    B, n, _ = x_new.shape
    G, d = module.num_kv_heads, module.head_dim
    r = module.num_heads // G
    t = 0 if cache is None else cache[0].shape[-2]
    where = torch.arange(t, t + n)
    q = apply_rope(module.q_proj(x_new).view(B, n, G, r, d).permute(0, 2, 3, 1, 4), where, module.rope_base)
    k = apply_rope(module.k_proj(x_new).view(B, n, G, d).permute(0, 2, 1, 3), where, module.rope_base)
    v = module.v_proj(x_new).view(B, n, G, d).permute(0, 2, 1, 3)
    if cache is not None:
        k, v = torch.cat((cache[0], k), dim=-2), torch.cat((cache[1], v), dim=-2)
    scores = torch.einsum("bgrnd,bgsd->bgrns", q, k) * d ** -0.5
    allowed = torch.ones(n, t + n, dtype=torch.bool).tril(diagonal=t)
    scores = scores.masked_fill(~allowed, -math.inf)
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("bgrns,bgsd->bngrd", weights, v).reshape(B, n, G * r * d)
    return module.o_proj(out), (k, v)
'''}),
    Variant("absorbed-module-and-einsum-decoding", "mla", {
        MLA_MODULE: '''
import math

import torch
from torch import nn


class MultiHeadLatentAttention(nn.Module):
    """The forward absorbs the up-projections too: scores against the latent, one head at a time."""

    def __init__(self, d_model, num_heads, head_dim, kv_latent_dim, rope_dim, rope_base=10000.0):
        super().__init__()
        self.num_heads, self.head_dim, self.kv_latent_dim, self.rope_dim = num_heads, head_dim, kv_latent_dim, rope_dim
        self.rope_base = float(rope_base)
        self.q_proj = nn.Linear(d_model, num_heads * (head_dim + rope_dim), bias=False)
        self.kv_down = nn.Linear(d_model, kv_latent_dim, bias=False)
        self.k_up = nn.Linear(kv_latent_dim, num_heads * head_dim, bias=False)
        self.v_up = nn.Linear(kv_latent_dim, num_heads * head_dim, bias=False)
        self.k_rope = nn.Linear(d_model, rope_dim, bias=False) if rope_dim else None
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=False)

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        H, d, r = self.num_heads, self.head_dim, self.rope_dim
        q = self.q_proj(x).view(B, T, H, d + r)
        c = self.kv_down(x)
        where = torch.arange(T)
        k_rotary = apply_rope(self.k_rope(x), where, self.rope_base) if r else None
        outputs = []
        for i in range(H):
            w_k = self.k_up.weight[i * d:(i + 1) * d]
            w_v = self.v_up.weight[i * d:(i + 1) * d]
            scores = (q[:, :, i, :d] @ w_k) @ c.transpose(1, 2)
            if r:
                scores = scores + apply_rope(q[:, :, i, d:], where, self.rope_base) @ k_rotary.transpose(1, 2)
            scores = scores / math.sqrt(d + r)
            if mask is not None:
                scores = scores.masked_fill(~torch.broadcast_to(mask, (B, H, T, T))[:, i], -math.inf)
            weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
            outputs.append((weights @ c) @ w_v.T)
        return self.o_proj(torch.cat(outputs, dim=-1))
''',
        MLA_STEP: '''
import math

import torch


def mla_decode_step(module, x_new, cache=None):
    B, n, _ = x_new.shape
    H, d, c, r = module.num_heads, module.head_dim, module.kv_latent_dim, module.rope_dim
    t = 0 if cache is None else cache[0].shape[1]
    where = torch.arange(t, t + n)
    q = module.q_proj(x_new).view(B, n, H, d + r)
    latent = module.kv_down(x_new)
    rope_keys = apply_rope(module.k_rope(x_new), where, module.rope_base) if r else latent[..., :0]
    if cache is not None:
        latent, rope_keys = torch.cat((cache[0], latent), 1), torch.cat((cache[1], rope_keys), 1)
    q_latent = torch.einsum("bnhd,hdc->bnhc", q[..., :d], module.k_up.weight.view(H, d, c))
    scores = torch.einsum("bnhc,bsc->bnhs", q_latent, latent)
    if r:
        scores = scores + torch.einsum("bnhr,bsr->bnhs", apply_rope(q[..., d:], where[:, None], module.rope_base),
                                       rope_keys)
    scores = scores * (d + r) ** -0.5
    scores = scores.masked_fill(torch.arange(t + n) > where[:, None, None], -math.inf)
    weights = torch.softmax(scores, dim=-1)
    context = torch.einsum("bnhs,bsc->bnhc", weights, latent)
    out = torch.einsum("bnhc,hdc->bnhd", context, module.v_up.weight.view(H, d, c))
    return module.o_proj(out.reshape(B, n, H * d)), (latent, rope_keys)
'''}),
]


@pytest.mark.parametrize("variant", WRONG, ids=variant_id)
def test_a_wrong_answer_fails_exactly_the_tests_it_breaks(variant):
    assert_loses_exactly(variant)


@pytest.mark.parametrize("variant", RIGHT, ids=variant_id)
def test_a_right_answer_in_another_style_passes_every_test(variant):
    results, violations = grade_in_process(variant.exercise, learner_notebook(variant.exercise, variant.answers))
    assert not violations
    assert failed(results) == set()


def learner_namespace(exercise_id: str, answers: dict[str, str]) -> dict:
    """The notebook's code run in this process, as `grade_in_process` runs it."""
    namespace = {"__name__": "__main__"}
    for cell in extract.code_cells(learner_notebook(exercise_id, answers)):
        exec(compile(cell.source, f"<cell {cell.number}>", "exec"), namespace)
    return namespace


def hidden_test_functions(exercise_id: str) -> list[str]:
    names = {test.name.split("[")[0] for test in catalogue(exercises.get(exercise_id)) if not test.visible}
    return sorted(function_of_test(name) for name in names)


@pytest.mark.parametrize("variant", WRONG + RIGHT, ids=variant_id)
@on_every_seed(SEEDS, fast=False)  # the fast tier grades every answer on SEED above
def test_every_answer_loses_exactly_its_hidden_tests_on_every_seed(variant, seed):
    """The hidden inputs change with the instructor's seed; what each answer loses must not."""
    namespace = learner_namespace(variant.exercise, variant.answers)
    results, violations, _ = self_check.run_in_kernel(exercises.get(variant.exercise), namespace, seed,
                                                      *hidden_test_functions(variant.exercise))
    lost = {result.name for result in results if not result.passed}
    assert not violations and all(not result.visible for result in results)
    assert variant.hidden_failures <= lost <= variant.hidden_failures | variant.hidden_may_fail, (seed, lost)


def test_the_naive_decoding_would_fail_the_memory_rule_by_a_wide_margin_on_every_seed():
    for seed in (None, *range(20)):
        sent = sent_inputs("mla", seed)
        for case in ("memory-rule", "memory-rule-random") if seed is not None else ("memory-rule",):
            bounds = MLA_TESTS.memory_bounds(sent[case][0])
            assert bounds[MLA_TESTS.EXPANDED] >= 2 * bounds[MLA_TESTS.LIMIT], (seed, case, bounds)


FEEDBACK = [
    ("mla", "latent-expanded-into-per-head-keys", "memory-rule",
     "memory rule broken: the largest tensor created by mla_decode_step holds 65,536 elements, 3.2x the 20,480 "
     "allowed"),
    ("mla", "cache-of-per-head-keys-and-values", "decode-token-by-token",
     "mla_decode_step(module, x[:, 0:1], cache) returned the cache's latent of shape (2, 4, 1, 12); "
     "expected (2, 1, 12)"),
    ("rope", "cache-of-unrotated-keys", "decode-token-by-token", "`chunks 1+1+1+1+1+1: cache k`: max abs error"),
    ("rope", "no-value-error-for-an-odd-width", "rope-odd-width",
     "`apply_rope(x of shape (2, 4, 5), positions) raises`: expected 'ValueError', got 'RuntimeError'"),
]


@pytest.mark.parametrize("exercise_id, name, case, message", FEEDBACK, ids=[f[1] for f in FEEDBACK])
def test_feedback_says_precisely_what_is_wrong(exercise_id, name, case, message):
    variant = next(v for v in WRONG if v.name == name and v.exercise == exercise_id)
    results, _ = grade_in_process(variant.exercise, learner_notebook(variant.exercise, variant.answers))
    assert any(problem.startswith(message) for problem in results[case].problems), results[case].problems


def test_the_steps_are_given_only_the_attributes_of_the_contract():
    rope_module = rope_definition.given_rotary_module(sent_inputs("rope", None)[
        "decode-given-cache[cache of 4 tokens]"][0])
    assert sorted(vars(rope_module)) == ["head_dim", "k_proj", "num_heads", "num_kv_heads", "o_proj", "q_proj",
                                         "rope_base", "v_proj"]
    assert rope_module.rope_base == 100.0
    for case, rope in (("decode-chunked-prefill[rope_dim > 0]", True), ("decode-chunked-prefill[rope_dim 0]", False)):
        module = mla_definition.given_module(sent_inputs("mla", None)[case][0])
        assert sorted(vars(module)) == ["head_dim", "k_rope", "k_up", "kv_down", "kv_latent_dim", "num_heads",
                                        "o_proj", "q_proj", "rope_base", "rope_dim", "v_up"]
        assert (module.k_rope is not None) == rope and all(
            layer.bias is None for layer in (module.q_proj, module.kv_down, module.k_up, module.v_up, module.o_proj))


# The references against independent oracles.

def complex_rope(x, positions, base=10000.0, interleaved=False):
    """RoPE as the multiplication of each pair, read as a complex number, by exp(i p theta_j)."""
    d = x.shape[-1]
    theta = torch.tensor([base ** (-2 * j / d) for j in range(d // 2)], dtype=torch.float64)
    turn = torch.polar(torch.ones((), dtype=torch.float64), positions.double()[..., None] * theta)
    wide = x.double()
    if interleaved:
        pairs = torch.view_as_complex(wide.reshape(*wide.shape[:-1], d // 2, 2).contiguous())
        return torch.view_as_real(pairs * turn).reshape(*(pairs * turn).shape[:-1], d).to(x.dtype)
    pairs = torch.view_as_complex(torch.stack([wide[..., : d // 2], wide[..., d // 2:]], dim=-1).contiguous())
    rotated = torch.view_as_real(pairs * turn)
    return torch.cat([rotated[..., 0], rotated[..., 1]], dim=-1).to(x.dtype)


POSITION_CASES = {"(T,)": lambda B, H, T: torch.arange(T) * 7 + 3, "(B, 1, T)": lambda B, H, T: torch.randint(
    0, 500, (B, 1, T)), "(B, H, T)": lambda B, H, T: torch.randint(0, 500, (B, H, T))}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("base", [10000.0, 500000.0, 100.0])
@pytest.mark.parametrize("shape", list(POSITION_CASES))
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_reference_apply_rope_is_complex_multiplication(interleaved, shape, base, dtype):
    torch.manual_seed(len(shape))
    x = torch.randn(2, 3, 5, 8, dtype=dtype)
    positions = POSITION_CASES[shape](2, 3, 5)
    if dtype == torch.float32:
        positions = positions % 32  # float32 angles are exact enough only for small positions
    got = ROPE["apply_rope"](x, positions, base=base, interleaved=interleaved)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, complex_rope(x, positions, base, interleaved))


def test_reference_apply_rope_layouts_differ_by_a_fixed_permutation_and_keep_lengths():
    x, positions = torch.randn(4, 6, 12, dtype=torch.float64), torch.arange(6)
    halves_to_pairs = torch.stack([torch.arange(6), torch.arange(6) + 6], dim=-1).flatten()  # 0, 6, 1, 7, ...
    interleaved = ROPE["apply_rope"](x[..., halves_to_pairs], positions, interleaved=True)
    torch.testing.assert_close(interleaved, ROPE["apply_rope"](x, positions)[..., halves_to_pairs])
    torch.testing.assert_close(ROPE["apply_rope"](x, positions).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(ROPE["apply_rope"](x, torch.zeros(6, dtype=torch.int64)), x)


def test_reference_rope_scores_depend_only_on_the_distance():
    q, k = torch.randn(1, 16, dtype=torch.float64), torch.randn(1, 16, dtype=torch.float64)
    rotate = lambda x, p: ROPE["apply_rope"](x, torch.tensor([p]))  # noqa: E731
    scores = [(rotate(q, p) @ rotate(k, p + 5).T).item() for p in (0, 1, 17, 1000)]
    assert max(scores) - min(scores) < 1e-10
    assert abs((rotate(q, 0) @ rotate(k, 6).T).item() - scores[0]) > 1e-6


def test_reference_apply_rope_raises_on_an_odd_width_and_changes_nothing():
    with pytest.raises(ValueError):
        ROPE["apply_rope"](torch.randn(3, 5), torch.arange(3))
    x, positions = torch.randn(2, 4, 6), torch.arange(4)
    kept = x.clone(), positions.clone()
    ROPE["apply_rope"](x, positions, interleaved=True)
    assert torch.equal(x, kept[0]) and torch.equal(positions, kept[1])


def seeded_rotary(d_model, heads, kv_heads, bias, dtype, seed, base):
    torch.manual_seed(seed)
    module = ROPE["RotaryGroupedQueryAttention"](d_model, heads, kv_heads, bias=bias, rope_base=base).to(dtype)
    if bias:
        with torch.no_grad():
            for layer in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
                layer.bias.normal_()
    return module


def torch_rotary(module, x, mask=None, is_causal=False):
    """Heads rotated as complex numbers, then PyTorch's attention with enable_gqa=True."""
    B, T, d_model = x.shape
    positions = torch.arange(T)
    q = complex_rope(module.q_proj(x).view(B, T, module.num_heads, -1).transpose(1, 2), positions, module.rope_base)
    k = complex_rope(module.k_proj(x).view(B, T, module.num_kv_heads, -1).transpose(1, 2), positions,
                     module.rope_base)
    v = module.v_proj(x).view(B, T, module.num_kv_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return module.o_proj(out.transpose(1, 2).reshape(B, T, d_model)), k, v


ROTARY_CASES = [  # d_model, heads, kv heads, bias, base, mask
    (32, 4, 2, True, 10000.0, "causal"), (48, 8, 2, False, 500.0, "random"), (32, 4, 1, True, 1e6, None),
    (32, 4, 4, False, 100.0, "causal"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("d_model, heads, kv_heads, bias, base, mask_kind", ROTARY_CASES)
def test_reference_rotary_module_agrees_with_torch_sdpa_on_rotated_heads(d_model, heads, kv_heads, bias, base,
                                                                       mask_kind, dtype):
    module = seeded_rotary(d_model, heads, kv_heads, bias, dtype, heads + kv_heads, base)
    assert (module.num_heads, module.num_kv_heads, module.head_dim, module.rope_base) == (
        heads, kv_heads, d_model // heads, base) and isinstance(module.rope_base, float)
    x, T = torch.randn(2, 7, d_model, dtype=dtype), 7
    mask = {None: None, "causal": torch.ones(T, T, dtype=torch.bool).tril(),
            "random": torch.rand(2, heads, T, T) < 0.6}[mask_kind]
    if mask_kind == "random":
        mask[..., 0] = True  # no row without a key: PyTorch gives NaN there, the contract 0
    with torch.no_grad():
        torch.testing.assert_close(module(x, mask=mask), torch_rotary(module, x, mask)[0])


def test_reference_rotary_module_raises_value_error_like_gqa():
    for bad in ((10, 4, 2), (16, 4, 3), (16, 4, 8)):
        with pytest.raises(ValueError):
            ROPE["RotaryGroupedQueryAttention"](*bad)
    assert ROPE["RotaryGroupedQueryAttention"](16, 4, 1).rope_base == 10000.0


def decode_in_chunks(step, module, x, sizes, cache=None):
    outputs, start = [], 0
    for size in sizes:
        out, cache = step(module, x[:, start:start + size], cache)
        outputs.append(out)
        start += size
    return torch.cat(outputs, dim=1), cache


CHUNKINGS = [[12], [1] * 12, [5, 1, 1, 1, 1, 1, 1, 1], [4, 4, 4], [3, 1, 5, 2, 1], [1, 11]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("heads, kv_heads, bias, base", [(8, 2, True, 10000.0), (4, 4, False, 500.0),
                                                         (8, 1, True, 100.0)])
def test_reference_rope_decoding_in_any_chunking_is_full_causal_attention(heads, kv_heads, bias, base, dtype):
    module = seeded_rotary(8 * heads, heads, kv_heads, bias, dtype, heads, base)
    given = SimpleNamespace(**{name: getattr(module, name) for name in (
        "q_proj", "k_proj", "v_proj", "o_proj", "num_heads", "num_kv_heads", "head_dim", "rope_base")})
    x = torch.randn(2, 12, 8 * heads, dtype=dtype)
    with torch.no_grad():
        full, keys, values = torch_rotary(module, x, is_causal=True)
        for sizes in CHUNKINGS:
            out, (k, v) = decode_in_chunks(ROPE["rope_decode_step"], given, x, sizes)
            assert out.dtype == k.dtype == dtype
            torch.testing.assert_close(out, full)
            torch.testing.assert_close(k, keys)  # the cache holds the keys rotated at their positions
            torch.testing.assert_close(v, values)


def test_reference_rope_step_after_a_given_cache_takes_positions_t_onwards():
    module = seeded_rotary(24, 6, 3, True, torch.float64, 5, 100.0)
    cache = (torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64))
    x_new = torch.randn(2, 3, 24, dtype=torch.float64)
    with torch.no_grad():
        out, (k, v) = ROPE["rope_decode_step"](module, x_new, cache)
        new_positions = torch.arange(4, 7)
        q = complex_rope(module.q_proj(x_new).view(2, 3, 6, 4).transpose(1, 2), new_positions, 100.0)
        new_keys = complex_rope(module.k_proj(x_new).view(2, 3, 3, 4).transpose(1, 2), new_positions, 100.0)
        assert torch.equal(k[:, :, :4], cache[0]) and torch.equal(v[:, :, :4], cache[1])
        torch.testing.assert_close(k[:, :, 4:], new_keys)
        mask = torch.tensor([[j <= 4 + i for j in range(7)] for i in range(3)])
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, module.o_proj(expected.transpose(1, 2).reshape(2, 3, 24)))


def seeded_latent(d_model, heads, head_dim, latent_dim, rope_dim, base, dtype, seed):
    torch.manual_seed(seed)
    return MLA["MultiHeadLatentAttention"](d_model, heads, head_dim, latent_dim, rope_dim, rope_base=base).to(dtype)


def explicit_mla(module, x, positions, mask=None, is_causal=False, latent=None, rope_keys=None):
    """MLA without absorption: every head's keys [k_up(c); rope(k_rope(x))] and values v_up(c) materialised,
    then PyTorch's attention, whose default scale 1/sqrt(head_dim + rope_dim) is the width of these keys."""
    B, T, _ = x.shape
    H, d, r = module.num_heads, module.head_dim, module.rope_dim
    latent = module.kv_down(x) if latent is None else latent
    S = latent.shape[1]
    q = module.q_proj(x).view(B, T, H, d + r).transpose(1, 2)
    keys = module.k_up(latent).view(B, S, H, d).transpose(1, 2)
    values = module.v_up(latent).view(B, S, H, d).transpose(1, 2)
    if r:
        rope_keys = complex_rope(module.k_rope(x), positions, module.rope_base) if rope_keys is None else rope_keys
        q = torch.cat([q[..., :d], complex_rope(q[..., d:], positions, module.rope_base)], dim=-1)
        keys = torch.cat([keys, rope_keys[:, None].expand(B, H, S, r)], dim=-1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal)
    return module.o_proj(out.transpose(1, 2).reshape(B, T, H * d)), rope_keys


MLA_CASES = [  # d_model, heads, head_dim, latent, rope_dim, base, mask
    (32, 4, 8, 12, 4, 10000.0, "causal"), (48, 6, 4, 16, 8, 500.0, "random"), (32, 4, 8, 12, 0, 10000.0, "causal"),
    (16, 1, 6, 4, 2, 100.0, None), (64, 8, 16, 32, 8, 1e6, "random"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("d_model, heads, head_dim, latent, rope_dim, base, mask_kind", MLA_CASES)
def test_reference_mla_module_is_attention_over_keys_materialised_per_head(d_model, heads, head_dim, latent,
                                                                         rope_dim, base, mask_kind, dtype):
    module = seeded_latent(d_model, heads, head_dim, latent, rope_dim, base, dtype, heads + rope_dim)
    shapes = {name: (layer.in_features, layer.out_features, layer.bias) for name, layer in module.named_children()}
    expected = {"q_proj": (d_model, heads * (head_dim + rope_dim), None), "kv_down": (d_model, latent, None),
                "k_up": (latent, heads * head_dim, None), "v_up": (latent, heads * head_dim, None),
                "o_proj": (heads * head_dim, d_model, None)}
    if rope_dim:
        expected["k_rope"] = (d_model, rope_dim, None)
    assert shapes == expected and (module.k_rope is None) == (rope_dim == 0)
    assert (module.num_heads, module.head_dim, module.kv_latent_dim, module.rope_dim, module.rope_base) == (
        heads, head_dim, latent, rope_dim, base) and isinstance(module.rope_base, float)
    T = 7
    x = torch.randn(2, T, d_model, dtype=dtype)
    mask = {None: None, "causal": torch.ones(T, T, dtype=torch.bool).tril(),
            "random": torch.rand(2, heads, T, T) < 0.6}[mask_kind]
    if mask_kind == "random":
        mask[..., 0] = True
    with torch.no_grad():
        torch.testing.assert_close(module(x, mask=mask), explicit_mla(module, x, torch.arange(T), mask)[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("d_model, heads, head_dim, latent, rope_dim, base, mask_kind", MLA_CASES)
def test_reference_mla_decoding_in_any_chunking_is_the_explicit_attention(d_model, heads, head_dim, latent, rope_dim,
                                                                        base, mask_kind, dtype):
    module = seeded_latent(d_model, heads, head_dim, latent, rope_dim, base, dtype, heads)
    x = torch.randn(2, 12, d_model, dtype=dtype)
    with torch.no_grad():
        full, rope_keys = explicit_mla(module, x, torch.arange(12), is_causal=True)
        for sizes in CHUNKINGS:
            out, (cached_latent, cached_rope) = decode_in_chunks(MLA["mla_decode_step"], module, x, sizes)
            torch.testing.assert_close(out, full)
            torch.testing.assert_close(cached_latent, module.kv_down(x))
            assert cached_rope.shape == (2, 12, rope_dim) and cached_rope.dtype == dtype
            if rope_dim:
                torch.testing.assert_close(cached_rope, rope_keys)


def test_reference_mla_step_after_a_given_cache_takes_positions_t_onwards():
    module = seeded_latent(24, 6, 4, 10, 8, 100.0, torch.float64, 7)
    cache = (torch.randn(2, 5, 10, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64))
    x_new = torch.randn(2, 3, 24, dtype=torch.float64)
    with torch.no_grad():
        out, (latent, rope_keys) = MLA["mla_decode_step"](module, x_new, cache)
        positions = torch.arange(5, 8)
        new_rope = complex_rope(module.k_rope(x_new), positions, 100.0)
        assert torch.equal(latent[:, :5], cache[0]) and torch.equal(rope_keys[:, :5], cache[1])
        torch.testing.assert_close(latent[:, 5:], module.kv_down(x_new))
        torch.testing.assert_close(rope_keys[:, 5:], new_rope)
        mask = torch.tensor([[j <= 5 + i for j in range(8)] for i in range(3)])
        expected, _ = explicit_mla(module, x_new, positions, mask, latent=latent, rope_keys=rope_keys)
        torch.testing.assert_close(out, expected)


def footprint(step, module, x_new, cache) -> int:
    with measure.Footprint() as measured, torch.no_grad():
        step(module, x_new, cache)
    return measured.largest


@pytest.mark.parametrize("rope_dim", [8, 0])
def test_reference_mla_step_keeps_the_contracts_memory_bound_and_the_explicit_step_does_not(rope_dim):
    """The bound of the contract, computed here from its formula, for one new token after 255."""
    B, H, d, c, d_model, t = 2, 8, 16, 32, 64, 255
    module = seeded_latent(d_model, H, d, c, rope_dim, 10000.0, torch.float32, 3)
    cache = (torch.randn(B, t, c), torch.randn(B, t, rope_dim))
    x_new = torch.randn(B, 1, d_model)
    largest_weight = max(p.numel() for p in module.parameters())
    bound = max(B * H * (t + 1) * 2, B * H * max(c, d + rope_dim), B * (t + 1) * (c + rope_dim), largest_weight)
    assert footprint(MLA["mla_decode_step"], module, x_new, cache) <= bound

    def explicit_step(module, x_new, cache):  # materialises every head's keys from the latent
        latent = torch.cat([cache[0], module.kv_down(x_new)], dim=1)
        return module.k_up(latent), module.v_up(latent)

    assert footprint(explicit_step, module, x_new, cache) == B * (t + 1) * H * d > 2 * bound


def test_the_memory_probe_measures_what_the_contract_bounds():
    inputs = sent_inputs("mla", None)["memory-rule"][0]
    measured = mla_definition.decode_memory(SimpleNamespace(mla_decode_step=MLA["mla_decode_step"]), inputs)
    assert measured[MLA_TESTS.LIMIT] == 20480 and measured[MLA_TESTS.EXPANDED] == 65536
    assert measured[MLA_TESTS.LARGEST] <= measured[MLA_TESTS.LIMIT]


def test_reference_mla_cache_bytes_matches_the_papers():
    size = MLA["mla_cache_bytes"]
    # DeepSeek-V2: (d_c + d_h^R) l = 9/2 d_h l elements per token, d_c = 4 d_h = 512, d_h^R = d_h / 2 = 64, 60 layers.
    d_h, layers = 128, 60
    assert size(layers, 4 * d_h, d_h // 2, 1, 1, bytes_per_element=1) == 9 * d_h * layers // 2
    assert size(60, 512, 64, 1, 1) == 67.5 * 2**10  # bf16: 67.5 KiB per token
    # Against MHA with DeepSeek-V2's 128 heads of 128 (2 n_h d_h l per token): 57x smaller.
    assert 2 * 128 * 128 * 60 * 2 / size(60, 512, 64, 1, 1) == pytest.approx(56.9, abs=0.1)
    assert size(60, 512, 64, 4096, 8, bytes_per_element=4) == 2 * size(60, 512, 64, 4096, 8)
    assert isinstance(size(1, 1, 0, 1, 1), int) and size(1, 512, 0, 1, 1) == 1024


@pytest.mark.parametrize("exercise_id", ["rope", "mla"])
@on_every_seed(tuple(range(30)))
def test_the_hidden_inputs_are_valid_for_many_seeds(exercise_id, seed):
    for case, sent in sent_inputs(exercise_id, seed).items():
        inputs = sent[0] if sent else None
        if not isinstance(inputs, Inputs):
            continue
        for sizes in inputs.get("chunkings", []):
            assert sum(sizes) == inputs["x"].shape[1] and min(sizes) >= 1
        if case.startswith("decode-random"):
            # some chunk of several tokens after the first, where positions and the mask's alignment matter
            assert all(len(sizes) >= 2 for sizes in inputs["chunkings"])
            assert any(any(n > 1 for n in sizes[1:]) for sizes in inputs["chunkings"])
        if case.startswith("rope-random"):
            assert inputs["x"].shape[-1] >= 4 and (inputs["positions"] > 0).all()
        if exercise_id == "rope" and "num_heads" in inputs.values:
            assert (inputs["d_model"] // inputs["num_heads"]) % 2 == 0


# The notebooks.

def source_notebook(exercise_id: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / exercises.get(exercise_id).notebook, as_version=4)


@pytest.mark.parametrize("exercise_id", ["rope", "mla"])
def test_the_notebooks_link_their_chapters_and_papers_and_import_no_other_notebook(exercise_id):
    notebook = source_notebook(exercise_id)
    prose = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert set(re.findall(r"https://mha-derived\.github\.io/mha-derived/book/([a-z0-9-]+)\.html", prose)) == {
        "mqa-gqa", "kv-cache", "contract"}
    assert {"rope": "arxiv.org/abs/2104.09864", "mla": "arxiv.org/abs/2405.04434"}[exercise_id] in prose
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert not re.search(r"import (sdpa|mha|gqa|kv_cache|rope)\b|from (sdpa|mha|gqa|kv_cache|rope) |%run|"
                         r"import_ipynb|\.ipynb", code)


def test_the_mla_notebook_defines_its_own_rotation():
    """The solution cells run alone, in order: nothing comes from the rope notebook."""
    cells = [c for c in source_notebook("mla").cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    assert [c.metadata["nbgrader"]["grade_id"] for c in cells] == ["apply_rope", MLA_MODULE, MLA_STEP, MLA_BYTES]
    names: dict = {}
    for cell in cells:
        exec(cell.source, names)
    module = names[MLA_MODULE](16, 2, 4, 6, 2)
    out, (latent, rope_keys) = names[MLA_STEP](module, torch.randn(1, 3, 16))
    assert out.shape == (1, 3, 16) and latent.shape == (1, 3, 6) and rope_keys.shape == (1, 3, 2)
    assert math.isfinite(out.abs().sum().item())
