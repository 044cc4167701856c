"""What an exercise's definition (`autograde/exercises/<id>.py`) uses to make calls on a learner's code.

An `@adapter` is a call the tests can make on `submission` and `reference`: it runs where the
learner's code runs (the sandboxed worker, when grading), receives the learner's names as
attributes, and returns what is observed and sent back. The helpers below build the learner's
nn.Modules for the structure tests and load the case's weights into them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from autograde.cases import Inputs
from autograde.observe import ContractError, raised


def adapter(function: Callable) -> Callable:
    """Mark `function(learner, ...)` as a call the tests can make on `submission` and `reference`.

    It runs where the learner's code runs (the sandboxed worker, when grading) and receives the
    learner's names as attributes of `learner`; what it returns is observed and sent back.
    """
    function.__autograde_adapter__ = True
    return function


def adapters_of(module) -> dict[str, Callable]:
    return {name: value for name, value in vars(module).items() if getattr(value, "__autograde_adapter__", False)}


# The learner's nn.Modules: what the structure tests observe, and the case's weights loaded into them.

_ABSENT = object()


def describe_layer(module: Any, name: str) -> str:
    """`module.<name>` as the tests name it: `nn.Linear(in, out, bias=...)`, another module's class
    name, `None`, or `missing` where there is no such attribute."""
    layer = getattr(module, name, _ABSENT)
    if layer is _ABSENT:
        return "missing"
    if layer is None:
        return "None"
    if isinstance(layer, nn.Linear):
        return f"nn.Linear({layer.in_features}, {layer.out_features}, bias={layer.bias is not None})"
    return type(layer).__name__


def structure_of(module: Any, call: str, layers: Iterable[str], attributes: Iterable[str] = ()) -> dict:
    """What a structure test compares: whether `module` (made by `call`) is an nn.Module, its layers
    described, and its attributes as they are."""
    outputs = {f"{call} is an nn.Module": isinstance(module, nn.Module)}
    outputs.update({f"{call}.{name}": describe_layer(module, name) for name in layers})
    outputs.update({f"{call}.{attribute}": getattr(module, attribute, None) for attribute in attributes})
    return outputs


def learner_module(module: Any, class_name: str) -> nn.Module:
    """What the learner's `class_name(...)` returned, which must be an nn.Module."""
    if not isinstance(module, nn.Module):
        raise ContractError(f"{class_name}(...) should be an nn.Module; it is {type(module).__name__}")
    return module


def load_layers(module: nn.Module, class_name: str, expected: Mapping[str, str], inputs: Inputs) -> None:
    """Each layer named in `expected` described as expected (`describe_layer`), else a ContractError;
    each that is a layer given the case's `<name>.weight`, and `<name>.bias` where the case has one."""
    for name, wanted in expected.items():
        found = describe_layer(module, name)
        if found != wanted:
            raise ContractError(f"{class_name}.{name} should be {wanted}; it is {found}")
        layer = getattr(module, name)
        if isinstance(layer, nn.Module):
            with torch.no_grad():
                layer.weight.copy_(inputs[f"{name}.weight"])
                if f"{name}.bias" in inputs.values:
                    layer.bias.copy_(inputs[f"{name}.bias"])


def constructor_errors(class_name: str) -> Callable:
    """An adapter: what `class_name(*arguments)` raises for each tuple of `inputs["calls"]`."""
    @adapter
    def value_errors(functions, inputs: Inputs) -> dict:
        return {f"{class_name}({', '.join(map(str, arguments))}) raises":
                raised(ValueError, getattr(functions, class_name), *arguments) for arguments in inputs["calls"]}
    return value_errors


def byte_counts(function_name: str) -> Callable:
    """An adapter: what `function_name(*args)` returns for each `(args, bytes_per_element)` of
    `inputs["calls"]`, given `bytes_per_element=` where it is not None."""
    @adapter
    def cache_sizes(functions, inputs: Inputs) -> dict:
        outputs = {}
        for args, bytes_per_element in inputs["calls"]:
            keyword = {} if bytes_per_element is None else {"bytes_per_element": bytes_per_element}
            shown = ", ".join([*map(str, args), *(f"{k}={v}" for k, v in keyword.items())])
            outputs[f"{function_name}({shown})"] = getattr(functions, function_name)(*args, **keyword)
        return outputs
    return cache_sizes


def module_attention(build_module: Callable) -> Callable:
    """An adapter: the learner's module made by `build_module(functions, inputs)`, applied to
    `inputs["x"]`, with `mask=` where the case has one."""
    @adapter
    def attention(functions, inputs: Inputs) -> dict:
        module = build_module(functions, inputs)
        mask = inputs.get("mask")
        return {"out": module(inputs["x"]) if mask is None else module(inputs["x"], mask=mask)}
    return attention
