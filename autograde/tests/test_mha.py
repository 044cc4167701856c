"""`mha`: splitting and merging heads, the MultiHeadAttention module, loading nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autograde.cases import NOT_ALLOWED_ATTENTION, Draw, Exercise, Inputs
from autograde.sandbox.observe import ContractError, pair, raised
from autograde.testing import adapter, assert_same
from autograde.tests.test_sdpa import random_mask

SPLIT, MERGE, MODULE, LOAD = "split_heads", "merge_heads", "MultiHeadAttention", "load_torch_mha"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def describe_layer(layer) -> str:
    if layer is None:
        return "missing"
    if isinstance(layer, nn.Linear):
        return f"nn.Linear({layer.in_features}, {layer.out_features}, bias={layer.bias is not None})"
    return type(layer).__name__


def build_module(functions, inputs: Inputs, dtype: torch.dtype) -> nn.Module:
    d_model, num_heads, bias = inputs["d_model"], inputs["num_heads"], inputs["bias"]
    module = functions.MultiHeadAttention(d_model, num_heads, bias=bias)
    if not isinstance(module, nn.Module):
        raise ContractError(f"MultiHeadAttention(...) should be an nn.Module; it is {type(module).__name__}")
    return module.to(dtype)


def set_projections(module: nn.Module, inputs: Inputs) -> None:
    """Give the learner's projections the case's weights, so that outputs can be compared."""
    d_model, bias = inputs["d_model"], inputs["bias"]
    expected = f"nn.Linear({d_model}, {d_model}, bias={bias})"
    for name in PROJECTIONS:
        layer = getattr(module, name, None)
        if describe_layer(layer) != expected:
            raise ContractError(f"MultiHeadAttention.{name} should be {expected}; it is {describe_layer(layer)}")
        with torch.no_grad():
            layer.weight.copy_(inputs[f"{name}.weight"])
            if bias:
                layer.bias.copy_(inputs[f"{name}.bias"])


def forward(module, *args, mask=None) -> tuple:
    names = ["query", "key", "value"][: len(args)]
    call = f"MultiHeadAttention.forward({', '.join(names)}{', mask=mask' if mask is not None else ''})"
    return pair(module(*args, **({} if mask is None else {"mask": mask})), call)


# Probes.

@adapter
def heads(functions, inputs: Inputs) -> dict:
    x = inputs["x"]
    return {f"split_heads(x, {h})": functions.split_heads(x, h) for h in inputs["num_heads"]}


@adapter
def round_trip(functions, inputs: Inputs) -> dict:
    outputs = {
        f"merge_heads(split_heads(x, {h}))": functions.merge_heads(functions.split_heads(inputs["x"], h))
        for h in inputs["num_heads"]
    }
    outputs["merge_heads(y)"] = functions.merge_heads(inputs["y"])
    return outputs


@adapter
def indivisible(functions, inputs: Inputs) -> dict:
    x = inputs["x"]
    return {
        f"split_heads(x of width {x.shape[-1]}, {h}) raises": raised(ValueError, functions.split_heads, x, h)
        for h in inputs["num_heads"]
    }


@adapter
def structure(functions, inputs: Inputs) -> dict:
    d_model, num_heads = inputs["d_model"], inputs["num_heads"]
    outputs = {}
    for bias in (True, False):
        module = functions.MultiHeadAttention(d_model, num_heads, bias=bias)
        call = f"MultiHeadAttention({d_model}, {num_heads}, bias={bias})"
        outputs[f"{call} is an nn.Module"] = isinstance(module, nn.Module)
        for name in PROJECTIONS:
            outputs[f"{call}.{name}"] = describe_layer(getattr(module, name, None))
    for d_model, num_heads in inputs["indivisible"]:
        outputs[f"MultiHeadAttention({d_model}, {num_heads}) raises"] = raised(
            ValueError, functions.MultiHeadAttention, d_model, num_heads)
    return outputs


@adapter
def attention(functions, inputs: Inputs) -> dict:
    module = build_module(functions, inputs, inputs["query"].dtype)
    set_projections(module, inputs)
    args = [inputs[name] for name in ("query", "key", "value")]
    out, weights = forward(module, *args, mask=inputs.get("mask"))
    return {"out": out, "weights": weights}


@adapter
def defaults(functions, inputs: Inputs) -> dict:
    module = build_module(functions, inputs, inputs["query"].dtype)
    set_projections(module, inputs)
    self_out, self_weights = forward(module, inputs["query"])
    cross_out, cross_weights = forward(module, inputs["query"], inputs["key"])
    return {"module(query)[0]": self_out, "module(query)[1]": self_weights,
            "module(query, key)[0]": cross_out, "module(query, key)[1]": cross_weights}


@adapter
def loaded(functions, inputs: Inputs) -> dict:
    dtype = inputs["query"].dtype
    d_model, num_heads, bias = inputs["d_model"], inputs["num_heads"], inputs["bias"]
    torch_mha = nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True).to(dtype)
    with torch.no_grad():
        torch_mha.in_proj_weight.copy_(inputs["in_proj_weight"])
        torch_mha.out_proj.weight.copy_(inputs["out_proj.weight"])
        if bias:
            torch_mha.in_proj_bias.copy_(inputs["in_proj_bias"])
            torch_mha.out_proj.bias.copy_(inputs["out_proj.bias"])
    module = build_module(functions, inputs, dtype)
    returned = functions.load_torch_mha(module, torch_mha)
    out, weights = forward(module, inputs["query"], inputs["key"], inputs["value"])
    return {"load_torch_mha(module, torch_mha) is module": returned is module, "out": out, "weights": weights}


# Inputs.

def projection_weights(draw: Draw, d_model: int, bias: bool, dtype) -> dict:
    scale = d_model ** -0.5
    values = {}
    for name in PROJECTIONS:
        values[f"{name}.weight"] = draw.normal(d_model, d_model, dtype=dtype, scale=scale)
        if bias:
            values[f"{name}.bias"] = draw.normal(d_model, dtype=dtype, scale=scale)
    return values


def torch_mha_weights(draw: Draw, d_model: int, bias: bool, dtype) -> dict:
    scale = d_model ** -0.5
    values = {"in_proj_weight": draw.normal(3 * d_model, d_model, dtype=dtype, scale=scale),
              "out_proj.weight": draw.normal(d_model, d_model, dtype=dtype, scale=scale)}
    if bias:
        values["in_proj_bias"] = draw.normal(3 * d_model, dtype=dtype, scale=scale)
        values["out_proj.bias"] = draw.normal(d_model, dtype=dtype, scale=scale)
    return values


def sequences(draw: Draw, B: int, L: int, S: int, d_model: int, dtype, cross: bool = True) -> dict:
    query = draw.normal(B, L, d_model, dtype=dtype)
    if not cross:
        return {"query": query, "key": query, "value": query}
    return {"query": query, "key": draw.normal(B, S, d_model, dtype=dtype),
            "value": draw.normal(B, S, d_model, dtype=dtype)}


def module_inputs(sequence_values: dict, d_model: int, num_heads: int, bias: bool, weights: dict) -> dict:
    return {**sequence_values, "d_model": d_model, "num_heads": num_heads, "bias": bias, **weights}


def split_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 5, 12), "num_heads": [3, 1, 12]})


def round_trip_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 5, 12), "y": draw.normal(2, 3, 5, 4), "num_heads": [4, 6]})


def indivisible_inputs(draw: Draw) -> Inputs:
    return Inputs({"x": draw.normal(2, 5, 10), "num_heads": [3, 4]})


def structure_inputs(draw: Draw) -> Inputs:
    return Inputs({"d_model": 16, "num_heads": 4, "indivisible": [(10, 3), (16, 5)]})


def self_attention_inputs(draw: Draw) -> Inputs:
    dtype = torch.float64
    values = sequences(draw, B=2, L=5, S=5, d_model=16, dtype=dtype, cross=False)
    return Inputs(module_inputs(values, 16, 4, True, projection_weights(draw, 16, True, dtype)),
                  "self-attention (query = key = value), given projection weights, no mask")


def load_cross_inputs(draw: Draw) -> Inputs:
    dtype = torch.float32
    values = sequences(draw, B=2, L=4, S=6, d_model=12, dtype=dtype)
    return Inputs(module_inputs(values, 12, 3, True, torch_mha_weights(draw, 12, True, dtype)),
                  "weights of an nn.MultiheadAttention(12, 3, bias=True), cross-attention")


def masked_cross_inputs(draw: Draw) -> Inputs:
    num_heads = draw.choice([1, 2, 4])
    d_model, bias = num_heads * draw.integer(2, 6), draw.choice([True, False])
    B, L, S = draw.integer(1, 3), draw.integer(2, 7), draw.integer(1, 7)
    dtype = draw.choice([torch.float32, torch.float64])
    values = module_inputs(sequences(draw, B, L, S, d_model, dtype), d_model, num_heads, bias,
                           projection_weights(draw, d_model, bias, dtype))
    values["mask"], note = random_mask(draw, draw.choice([(L, S), (B, 1, L, S), (B, num_heads, L, S)]), 1)
    return Inputs(values, f"cross-attention, given projection weights, mask with {note}")


def defaults_inputs(draw: Draw) -> Inputs:
    num_heads = draw.choice([1, 2, 3, 6])
    d_model, dtype = num_heads * draw.integer(2, 4), torch.float64
    values = sequences(draw, draw.integer(1, 3), draw.integer(1, 6), draw.integer(1, 6), d_model, dtype)
    del values["value"]
    return Inputs(module_inputs(values, d_model, num_heads, True, projection_weights(draw, d_model, True, dtype)),
                  "given projection weights; key defaults to query, value to key")


def load_no_bias_inputs(draw: Draw) -> Inputs:
    num_heads = draw.choice([1, 2, 4, 8])
    d_model, dtype = num_heads * draw.integer(2, 4), draw.choice([torch.float32, torch.float64])
    values = sequences(draw, draw.integer(1, 3), draw.integer(1, 6), draw.integer(1, 6), d_model, dtype)
    return Inputs(module_inputs(values, d_model, num_heads, False, torch_mha_weights(draw, d_model, False, dtype)),
                  f"weights of an nn.MultiheadAttention({d_model}, {num_heads}, bias=False)")


def random_heads_inputs(draw: Draw) -> Inputs:
    head_dim, num_heads = draw.integer(1, 5), draw.integer(1, 6)
    x = draw.normal(draw.integer(1, 3), draw.integer(1, 7), num_heads * head_dim)
    y = draw.normal(draw.integer(1, 3), num_heads, draw.integer(1, 7), head_dim)
    return Inputs({"x": x, "y": y, "num_heads": [num_heads, 1]})


@adapter
def heads_and_round_trip(functions, inputs: Inputs) -> dict:
    return {**heads(functions, inputs), **round_trip(functions, inputs)}


EXERCISE = Exercise(
    id="mha",
    assignment="attention",
    title="Multi-head attention",
    required=(SPLIT, MERGE, MODULE, LOAD),
    not_allowed=NOT_ALLOWED_ATTENTION,
)


# The tests.

@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT)
def test_split_heads(submission, reference, draw):
    """(B, T, H*d) -> (B, H, T, d), head h holding features h*d to (h+1)*d"""
    inputs = split_inputs(draw)
    got, expected = submission.heads(inputs), reference.heads(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT, MERGE)
def test_merge_heads(submission, reference, draw):
    """merge_heads undoes split_heads"""
    inputs = round_trip_inputs(draw)
    got, expected = submission.round_trip(inputs), reference.round_trip(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT)
def test_split_heads_value_error(submission, reference, draw):
    """ValueError when the width is not divisible by the heads"""
    inputs = indivisible_inputs(draw)
    got, expected = submission.indivisible(inputs), reference.indivisible(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_module_structure(submission, reference, draw):
    """q_proj, k_proj, v_proj, o_proj and the ValueError"""
    inputs = structure_inputs(draw)
    got, expected = submission.structure(inputs), reference.structure(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE)
def test_self_attention(submission, reference, draw):
    """outputs and per-head weights of self-attention"""
    inputs = self_attention_inputs(draw)
    got, expected = submission.attention(inputs), reference.attention(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE, LOAD)
def test_load_torch_mha(submission, reference, draw):
    """loads nn.MultiheadAttention's packed weights and biases"""
    inputs = load_cross_inputs(draw)
    got, expected = submission.loaded(inputs), reference.loaded(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE)
def test_masked_cross_attention(submission, reference, draw):
    """cross-attention with a broadcast mask"""
    inputs = masked_cross_inputs(draw)
    got, expected = submission.attention(inputs), reference.attention(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(1.0)
@pytest.mark.uses(MODULE)
def test_default_key_value(submission, reference, draw):
    """key defaults to query and value to key"""
    inputs = defaults_inputs(draw)
    got, expected = submission.defaults(inputs), reference.defaults(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(1.5)
@pytest.mark.uses(MODULE, LOAD)
def test_load_torch_mha_no_bias(submission, reference, draw):
    """loads an nn.MultiheadAttention without biases"""
    inputs = load_no_bias_inputs(draw)
    got, expected = submission.loaded(inputs), reference.loaded(inputs)
    assert_same(got, expected, inputs)


@pytest.mark.hidden
@pytest.mark.points(0.5)
@pytest.mark.uses(SPLIT, MERGE)
def test_heads_random(submission, reference, draw):
    """split_heads and merge_heads on random sizes"""
    inputs = random_heads_inputs(draw)
    got, expected = submission.heads_and_round_trip(inputs), reference.heads_and_round_trip(inputs)
    assert_same(got, expected, inputs)
