"""`mha`: splitting and merging heads, the MultiHeadAttention module, loading nn.MultiheadAttention.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_mha.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from autograde.adapters import adapter, learner_module, load_layers, structure_of
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.observe import ContractError, pair, raised

SPLIT, MERGE, MODULE, LOAD = "split_heads", "merge_heads", "MultiHeadAttention", "load_torch_mha"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_module(functions, inputs: Inputs, dtype: torch.dtype) -> nn.Module:
    """The learner's module in eval() mode (a test of its own holds train() mode to the same output)."""
    d_model, num_heads, bias = inputs["d_model"], inputs["num_heads"], inputs["bias"]
    module = learner_module(functions.MultiHeadAttention(d_model, num_heads, bias=bias), "MultiHeadAttention")
    return module.to(dtype).eval()


def set_projections(module: nn.Module, inputs: Inputs) -> None:
    """Give the learner's projections the case's weights, so that outputs can be compared."""
    d_model, bias = inputs["d_model"], inputs["bias"]
    expected = f"nn.Linear({d_model}, {d_model}, bias={bias})"
    load_layers(module, "MultiHeadAttention", dict.fromkeys(PROJECTIONS, expected), inputs)


def forward(module, *args, mask=None) -> tuple:
    names = ["query", "key", "value"][: len(args)]
    call = f"MultiHeadAttention.forward({', '.join(names)}{', mask=mask' if mask is not None else ''})"
    return pair(module(*args, **({} if mask is None else {"mask": mask})), call)


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
        outputs |= structure_of(module, f"MultiHeadAttention({d_model}, {num_heads}, bias={bias})", PROJECTIONS)
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
    """`module(query)`, or `module(query, key)` when the case has a key."""
    module = build_module(functions, inputs, inputs["query"].dtype)
    set_projections(module, inputs)
    args = [inputs[name] for name in ("query", "key") if name in inputs.values]
    shown = f"module({', '.join(name for name in ('query', 'key') if name in inputs.values)})"
    out, weights = forward(module, *args)
    return {f"{shown}[0]": out, f"{shown}[1]": weights}


@adapter
def train_and_eval(functions, inputs: Inputs) -> dict:
    module = build_module(functions, inputs, inputs["query"].dtype)
    set_projections(module, inputs)
    args = [inputs[name] for name in ("query", "key", "value")]
    outputs = {}
    for mode in ("train", "eval"):
        getattr(module, mode)()
        out, weights = forward(module, *args)
        outputs[f"in {mode}() mode: out"], outputs[f"in {mode}() mode: weights"] = out, weights
    return outputs


@adapter
def gradients(functions, inputs: Inputs) -> dict:
    """The gradients of (out * dout).sum() with respect to the inputs and the projections' weights,
    computed where the learner's code runs."""
    module = build_module(functions, inputs, inputs["query"].dtype)
    set_projections(module, inputs)
    args = [inputs[name].clone().requires_grad_(True) for name in ("query", "key", "value")]
    out, _ = forward(module, *args, mask=inputs["mask"])
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ContractError("MultiHeadAttention.forward returned an `out` that autograd cannot trace back to "
                            "query, key and value")
    (out * inputs["dout"]).sum().backward()
    grads = {f"{name}.grad": tensor.grad for name, tensor in zip(("query", "key", "value"), args)}
    return {**grads, **{f"{name}.weight.grad": getattr(module, name).weight.grad for name in PROJECTIONS}}


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
