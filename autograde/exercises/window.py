"""`window`: sliding-window attention, a rolling KV cache and attention sinks.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_window.py`.
"""

from __future__ import annotations

import torch

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX, Exercise, Inputs
from autograde.observe import ContractError, kind_of

MASK, ATTENTION, CACHE = "sliding_window_mask", "windowed_attention", "RollingKVCache"
HELD_BYTES, SAME_STORAGE = "bytes of the floating-point tensors the cache holds", \
    "the same storage after every append"


def held_tensors(root, depth: int = 0, seen: set | None = None) -> list[torch.Tensor]:
    """The tensors an object holds: in its attributes and in the lists, tuples, dicts and objects they hold."""
    seen = set() if seen is None else seen
    if id(root) in seen or depth > 4:
        return []
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        return [root]
    if isinstance(root, (list, tuple, set, frozenset)):
        items = list(root)
    elif isinstance(root, dict):
        items = list(root.values())
    elif hasattr(root, "__dict__") or hasattr(type(root), "__slots__"):
        items = list(getattr(root, "__dict__", {}).values())
        items += [getattr(root, name) for name in getattr(type(root), "__slots__", ()) if hasattr(root, name)]
    else:
        return []
    return [tensor for item in items for tensor in held_tensors(item, depth + 1, seen)]


def float_storages(cache) -> dict[int, int]:
    """The floating-point storages the cache holds: their bytes, by address."""
    return {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
            for tensor in held_tensors(cache) if tensor.is_floating_point()}


def checked_kept(result, call: str, shape: tuple[int, ...]) -> tuple:
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise ContractError(f"{call} must return three values (k, v, positions); it returned {kind_of(result)}")
    for name, value in zip(("k", "v", "positions"), result):
        if not isinstance(value, torch.Tensor):
            raise ContractError(f"{call} returned {name} that is {kind_of(value)}, not a tensor")
    if tuple(result[0].shape) != shape:
        raise ContractError(f"{call} returned k of shape {tuple(result[0].shape)}; expected {shape}")
    return tuple(result)


@adapter
def masks(functions, inputs: Inputs) -> dict:
    return {f"{MASK}({L}, {S}, {window})": functions.sliding_window_mask(L, S, window)
            for L, S, window in inputs["shapes"]}


@adapter
def attended(functions, inputs: Inputs) -> dict:
    arguments = {name: inputs[name].clone() for name in ("q", "k", "v")}
    sinks = inputs.get("sink_logits")
    if sinks is None:
        out = functions.windowed_attention(*arguments.values(), inputs["window"])
    else:
        out = functions.windowed_attention(*arguments.values(), inputs["window"], sink_logits=sinks.clone())
    kept = all(torch.equal(value, inputs[name]) for name, value in arguments.items())
    return {"out": out, f"{ATTENTION}(q, k, v, ...) leaves them unchanged": kept}


@adapter
def rolled(functions, inputs: Inputs) -> dict:
    """A cache fed the case's tokens in its `chunks`, then in its `more` chunks: what keys_values() returns
    after each of `chunks` and at the end (a reply holds 128 arrays at most), and the bytes and storages of
    the floating-point tensors the cache holds at the end."""
    k, v = inputs["k"], inputs["v"]
    batch, kv_heads, _, head_dim = k.shape
    window, sinks = inputs["window"], inputs["sinks"]
    cache = functions.RollingKVCache(batch, kv_heads, window, head_dim, sinks=sinks, dtype=k.dtype)
    outputs, start, storages, same = {}, 0, None, True
    recorded = len(inputs["chunks"])
    for index, size in enumerate(inputs["chunks"] + inputs["more"]):
        cache.append(k[:, :, start:start + size].clone(), v[:, :, start:start + size].clone())
        start += size
        held = float_storages(cache)
        storages = held if storages is None else storages
        same = same and held == storages
        if index < recorded or start == k.shape[2]:
            call = f"keys_values() after {start} tokens"
            kept = min(start, sinks + window)
            keys, values, positions = checked_kept(cache.keys_values(), call, (batch, kv_heads, kept, head_dim))
            outputs[call] = {"k": keys, "v": values, "positions": positions}
    outputs[HELD_BYTES], outputs[SAME_STORAGE] = sum(float_storages(cache).values()), same
    return outputs


@adapter
def filled(functions, inputs: Inputs) -> dict:
    """A cache of the case's size fed `appends` chunks of `chunk` tokens of keys and values made here, from
    the case's `seed` (many windows of tokens: more than the grader sends), in float32; the sandbox measures
    from outside how far the memory of the learner's processes rose meanwhile. Values are others' business:
    a key and a value per head are drawn, and each token's is that scaled by its position, in new memory
    for every chunk (a draw per chunk took half of the call's time)."""
    batch, kv_heads, head_dim, chunk = inputs["batch"], inputs["kv_heads"], inputs["head_dim"], inputs["chunk"]
    cache = functions.RollingKVCache(batch, kv_heads, inputs["window"], head_dim, sinks=inputs["sinks"],
                                     dtype=torch.float32)
    generator = torch.Generator().manual_seed(inputs["seed"])
    key, value = (torch.randn(batch, kv_heads, 1, head_dim, generator=generator) for _ in range(2))
    tokens = inputs["appends"] * chunk
    for start in range(0, tokens, chunk):
        scale = 1 + torch.arange(start, start + chunk, dtype=torch.float32).unsqueeze(-1) / tokens
        cache.append(key * scale, value * scale)
    return {"tokens appended": tokens}


EXERCISE = Exercise(
    id="window",
    assignment="windows",
    title="Sliding windows, a rolling cache and attention sinks",
    required=(MASK, ATTENTION, CACHE),
    not_allowed=NOT_ALLOWED_ATTENTION + NOT_ALLOWED_SOFTMAX,
)
