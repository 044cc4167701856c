"""`kv_cache`: one decoding step of grouped-query attention with a key/value cache.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_kv_cache.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.exercises.gqa import projection_shapes
from autograde.observe import ContractError, kind_of, pair

STEP = "gqa_decode_step"


def given_module(inputs: Inputs) -> SimpleNamespace:
    """q_proj, k_proj, v_proj, o_proj holding the case's weights, and the ints num_heads, num_kv_heads, head_dim."""
    d_model, num_heads, num_kv_heads, bias = (inputs[k] for k in ("d_model", "num_heads", "num_kv_heads", "bias"))
    layers = {}
    for name, (in_features, out_features) in projection_shapes(d_model, num_heads, num_kv_heads).items():
        weight = inputs[f"{name}.weight"]
        layer = nn.Linear(in_features, out_features, bias=bias, dtype=weight.dtype).requires_grad_(False)
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(inputs[f"{name}.bias"])
        layers[name] = layer
    return SimpleNamespace(**layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=d_model // num_heads)


def checked_tensor(value, call: str, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    """`value` if it is a tensor of `shape`; else the learner is told what the step returned."""
    if not isinstance(value, torch.Tensor):
        raise ContractError(f"{call} returned {what} that is {kind_of(value)}, not a tensor")
    if tuple(value.shape) != shape:
        raise ContractError(f"{call} returned {what} of shape {tuple(value.shape)}; expected {shape}")
    return value


@adapter
def decode(functions, inputs: Inputs) -> dict:
    """Feed `x` through the step in each chunking; the outputs joined, the cache after each step and at the end."""
    module, x = given_module(inputs), inputs["x"]
    batch, _, d_model = x.shape
    given = (inputs["cache_k"], inputs["cache_v"]) if "cache_k" in inputs.values else None
    cached = 0 if given is None else given[0].shape[2]
    outputs = {}
    for sizes in inputs["chunkings"]:
        label, cache, start, pieces = f"chunks {'+'.join(map(str, sizes))}", given, 0, []
        for size in sizes:
            call = f"gqa_decode_step(module, x[:, {start}:{start + size}], cache)"
            out, cache = pair(functions.gqa_decode_step(module, x[:, start:start + size], cache), call,
                              "(out, (k, v))")
            if not (isinstance(cache, (tuple, list)) and len(cache) == 2):
                raise ContractError(f"{call} should return the cache as a pair (k, v); it returned {kind_of(cache)}")
            pieces.append(checked_tensor(out, call, "out", (batch, size, d_model)))
            start += size
            for tensor in cache:  # the cache grows by the new tokens at every step
                checked_tensor(tensor, call, "a cache tensor",
                               (batch, module.num_kv_heads, cached + start, module.head_dim))
        outputs[f"{label}: out"] = torch.cat(pieces, dim=1)
        outputs[f"{label}: cache k"], outputs[f"{label}: cache v"] = cache
    return outputs


EXERCISE = Exercise(
    id="kv_cache",
    assignment="gqa",
    title="Incremental decoding with a KV cache",
    required=(STEP,),
    not_allowed=NOT_ALLOWED_ATTENTION,
)
