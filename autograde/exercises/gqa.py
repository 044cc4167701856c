"""`gqa`: repeat_kv, the GroupedQueryAttention module, converting MHA weights to GQA, the size of a KV cache.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_gqa.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from autograde.adapters import (
    adapter,
    byte_counts,
    constructor_errors,
    learner_module,
    load_layers,
    module_attention,
    structure_of,
)
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.exercises.mha import PROJECTIONS
from autograde.observe import ContractError

REPEAT, MODULE, CONVERT, BYTES = "repeat_kv", "GroupedQueryAttention", "mha_to_gqa", "kv_cache_bytes"


def projection_shapes(d_model: int, num_heads: int, num_kv_heads: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of GroupedQueryAttention."""
    kv_width = num_kv_heads * (d_model // num_heads)
    return {"q_proj": (d_model, d_model), "k_proj": (d_model, kv_width),
            "v_proj": (d_model, kv_width), "o_proj": (d_model, d_model)}


def linear_text(in_features: int, out_features: int, bias: bool) -> str:
    return f"nn.Linear({in_features}, {out_features}, bias={bias})"


def projection_texts(d_model: int, num_heads: int, num_kv_heads: int, bias: bool) -> dict[str, str]:
    """Each projection as `describe_layer` names it."""
    return {name: linear_text(in_features, out_features, bias)
            for name, (in_features, out_features) in projection_shapes(d_model, num_heads, num_kv_heads).items()}


@adapter
def repeats(functions, inputs: Inputs) -> dict:
    return {f"repeat_kv({name} of shape {tuple(inputs[name].shape)}, {n_rep})": functions.repeat_kv(inputs[name], n_rep)
            for name, n_rep in inputs["calls"]}


@adapter
def structure(functions, inputs: Inputs) -> dict:
    d_model, num_heads, num_kv_heads = inputs["d_model"], inputs["num_heads"], inputs["num_kv_heads"]
    outputs = {}
    for bias in (True, False):
        module = functions.GroupedQueryAttention(d_model, num_heads, num_kv_heads, bias=bias)
        call = f"GroupedQueryAttention({d_model}, {num_heads}, {num_kv_heads}, bias={bias})"
        outputs |= structure_of(module, call, PROJECTIONS, ("num_heads", "num_kv_heads", "head_dim"))
    return outputs


value_errors = constructor_errors("GroupedQueryAttention")


def build_module(functions, inputs: Inputs) -> nn.Module:
    """The learner's module, holding the case's weights, in the dtype of `x`."""
    d_model, num_heads, num_kv_heads, bias = (inputs[k] for k in ("d_model", "num_heads", "num_kv_heads", "bias"))
    module = functions.GroupedQueryAttention(d_model, num_heads, num_kv_heads, bias=bias)
    module = learner_module(module, "GroupedQueryAttention").to(inputs["x"].dtype)
    load_layers(module, "GroupedQueryAttention", projection_texts(d_model, num_heads, num_kv_heads, bias), inputs)
    return module


attention = module_attention(build_module)


def state_dict_of(inputs: Inputs) -> dict:
    return {name: value for name, value in inputs.values.items() if name.endswith(("weight", "bias"))}


@adapter
def converted(functions, inputs: Inputs) -> dict:
    num_heads, state_dict = inputs["num_heads"], state_dict_of(inputs)
    outputs = {}
    for num_kv_heads in inputs["num_kv_heads"]:
        call = f"mha_to_gqa(state_dict, {num_heads}, {num_kv_heads})"
        result = functions.mha_to_gqa({name: value.clone() for name, value in state_dict.items()},
                                      num_heads, num_kv_heads)
        if not isinstance(result, Mapping):
            raise ContractError(f"{call} should return a dict; it returned a {type(result).__name__}")
        outputs[f"{call}.keys()"] = ", ".join(sorted(map(str, result)))
        for name in state_dict:
            outputs[f"{call}[{name!r}]"] = result.get(name)
    return outputs


@adapter
def callers_state_dict(functions, inputs: Inputs) -> dict:
    """Whether mha_to_gqa returned a new dict and left the one it was given (keys and tensors) as it was."""
    num_heads, state_dict = inputs["num_heads"], state_dict_of(inputs)
    outputs = {}
    for num_kv_heads in inputs["num_kv_heads"]:
        call = f"mha_to_gqa(state_dict, {num_heads}, {num_kv_heads})"
        given = {name: value.clone() for name, value in state_dict.items()}
        result = functions.mha_to_gqa(given, num_heads, num_kv_heads)
        outputs[f"{call} returns a new dict"] = isinstance(result, Mapping) and result is not given
        outputs[f"{call} leaves state_dict unchanged"] = given.keys() == state_dict.keys() and all(
            isinstance(given[name], torch.Tensor) and given[name].shape == state_dict[name].shape
            and torch.equal(given[name], state_dict[name]) for name in state_dict)
    return outputs


cache_sizes = byte_counts("kv_cache_bytes")


EXERCISE = Exercise(
    id="gqa",
    assignment="gqa",
    title="Multi-query and grouped-query attention",
    required=(REPEAT, MODULE, CONVERT, BYTES),
    not_allowed=NOT_ALLOWED_ATTENTION,
)
