"""`rope`: rotary position embeddings, grouped-query attention that rotates its queries and keys,

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_rope.py`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from autograde.adapters import adapter, constructor_errors, learner_module, load_layers, module_attention, structure_of
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.exercises.gqa import projection_texts
from autograde.exercises.kv_cache import checked_tensor, given_module
from autograde.exercises.mha import PROJECTIONS
from autograde.observe import ContractError, kind_of, pair, raised

ROPE, MODULE, STEP = "apply_rope", "RotaryGroupedQueryAttention", "rope_decode_step"
DEFAULT_BASE = 10000.0


def options_text(options: dict) -> str:
    return "".join(f", {name}={value!r}" for name, value in options.items())


@adapter
def rotations(functions, inputs: Inputs) -> dict:
    """apply_rope on each (x, positions, options) of the case, and whether it left its arguments as they were."""
    outputs = {}
    for x_name, positions_name, options in inputs["calls"]:
        x, positions = inputs[x_name], inputs[positions_name]
        kept = (x.clone(), positions.clone())
        call = f"apply_rope({x_name}, {positions_name}{options_text(options)})"
        outputs[call] = functions.apply_rope(x, positions, **options)
        outputs[f"{call} leaves x and positions unchanged"] = torch.equal(x, kept[0]) and torch.equal(positions,
                                                                                                      kept[1])
    return outputs


@adapter
def odd_widths(functions, inputs: Inputs) -> dict:
    return {f"apply_rope(x of shape {tuple(inputs[name].shape)}, positions) raises":
            raised(ValueError, functions.apply_rope, inputs[name], torch.arange(inputs[name].shape[-2]))
            for name in inputs["names"]}


@adapter
def structure(functions, inputs: Inputs) -> dict:
    d_model, num_heads, num_kv_heads = inputs["d_model"], inputs["num_heads"], inputs["num_kv_heads"]
    outputs = {}
    for bias, base in ((True, None), (False, inputs["rope_base"])):
        keyword = {} if base is None else {"rope_base": base}
        module = functions.RotaryGroupedQueryAttention(d_model, num_heads, num_kv_heads, bias=bias, **keyword)
        arguments = f"{d_model}, {num_heads}, {num_kv_heads}, bias={bias}{options_text(keyword)}"
        outputs |= structure_of(module, f"RotaryGroupedQueryAttention({arguments})", PROJECTIONS,
                                ("num_heads", "num_kv_heads", "head_dim", "rope_base"))
    return outputs


value_errors = constructor_errors("RotaryGroupedQueryAttention")


def build_module(functions, inputs: Inputs) -> nn.Module:
    """The learner's module holding the case's weights, in the dtype of `x`; the default base unless one is given."""
    d_model, num_heads, num_kv_heads, bias = (inputs[k] for k in ("d_model", "num_heads", "num_kv_heads", "bias"))
    keyword = {} if inputs.get("rope_base") is None else {"rope_base": inputs["rope_base"]}
    module = functions.RotaryGroupedQueryAttention(d_model, num_heads, num_kv_heads, bias=bias, **keyword)
    module = learner_module(module, "RotaryGroupedQueryAttention").to(inputs["x"].dtype)
    load_layers(module, "RotaryGroupedQueryAttention", projection_texts(d_model, num_heads, num_kv_heads, bias),
                inputs)
    return module


attention = module_attention(build_module)


def decoded(step: Callable, name: str, module, x: torch.Tensor, chunkings: list[list[int]], given, cached: int,
            labels: tuple[str, str], shapes: Callable[[int], tuple]) -> dict:
    """Feed `x` through `step` in each chunking, starting from the cache `given` of `cached` tokens: the
    outputs joined and the cache at the end. After each step the cache tensors must have `shapes(tokens)`."""
    batch, _, d_model = x.shape
    names = f"(out, ({', '.join(labels)}))"
    outputs = {}
    for sizes in chunkings:
        label, cache, start, pieces = f"chunks {'+'.join(map(str, sizes))}", given, 0, []
        for size in sizes:
            call = f"{name}(module, x[:, {start}:{start + size}], cache)"
            out, cache = pair(step(module, x[:, start:start + size], cache), call, names)
            if not (isinstance(cache, (tuple, list)) and len(cache) == 2):
                raise ContractError(f"{call} should return the cache as a pair ({', '.join(labels)}); "
                                    f"it returned {kind_of(cache)}")
            pieces.append(checked_tensor(out, call, "out", (batch, size, d_model)))
            start += size
            for tensor, what, shape in zip(cache, labels, shapes(cached + start)):
                checked_tensor(tensor, call, f"the cache's {what}", shape)
        outputs[f"{label}: out"] = torch.cat(pieces, dim=1)
        for tensor, what in zip(cache, labels):
            outputs[f"{label}: cache {what}"] = tensor
    return outputs


def given_rotary_module(inputs: Inputs):
    """q_proj, k_proj, v_proj, o_proj with the case's weights, the ints of GroupedQueryAttention and rope_base."""
    module = given_module(inputs)
    module.rope_base = inputs["rope_base"]
    return module


@adapter
def decode(functions, inputs: Inputs) -> dict:
    """Feed `x` through rope_decode_step in each chunking; the outputs joined and the cache at the end."""
    module, x = given_rotary_module(inputs), inputs["x"]
    given = (inputs["cache_k"], inputs["cache_v"]) if "cache_k" in inputs.values else None
    cached = 0 if given is None else given[0].shape[2]
    shape = lambda tokens: (x.shape[0], module.num_kv_heads, tokens, module.head_dim)  # noqa: E731
    return decoded(functions.rope_decode_step, STEP, module, x, inputs["chunkings"], given, cached, ("k", "v"),
                   lambda tokens: (shape(tokens), shape(tokens)))


EXERCISE = Exercise(
    id="rope",
    assignment="positions",
    title="Rotary position embeddings, with a KV cache",
    required=(ROPE, MODULE, STEP),
    not_allowed=NOT_ALLOWED_ATTENTION,
)
