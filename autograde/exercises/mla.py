"""`mla`: multi-head latent attention (DeepSeek-V2), decoding from a cache of latents with the

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_mla.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from autograde.adapters import adapter, byte_counts, learner_module, load_layers, module_attention, structure_of
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.exercises.gqa import linear_text
from autograde.exercises.rope import DEFAULT_BASE, decoded, options_text
from autograde.observe import pair
from autograde.rules import measure

MODULE, STEP, BYTES = "MultiHeadLatentAttention", "mla_decode_step", "mla_cache_bytes"
LAYERS = ("q_proj", "kv_down", "k_up", "v_up", "k_rope", "o_proj")


LARGEST = "largest tensor created by mla_decode_step (elements)"
LIMIT = ("the largest of B*H*(t+1)*2, B*H*max(kv_latent_dim, head_dim + rope_dim), "
         "B*(t+1)*(kv_latent_dim + rope_dim) and the module's largest weight")
EXPANDED = "the cached latents expanded into per-head keys, B*(t+1)*H*head_dim"
# The work of the step, so that an expansion done in pieces, none of them large, shows too.
COMPUTED = "elements computed by mla_decode_step (every tensor returned but views)"
FLOPS = "matmul FLOPs of mla_decode_step"
EXPANSION_FLOPS = "matmul FLOPs of expanding the cached latents into per-head keys, 2*B*(t+1)*kv_latent_dim*H*head_dim"


def layer_shapes(d_model: int, num_heads: int, head_dim: int, kv_latent_dim: int, rope_dim: int) -> dict:
    """(in_features, out_features) of each projection of MultiHeadLatentAttention; no k_rope when rope_dim is 0."""
    shapes = {"q_proj": (d_model, num_heads * (head_dim + rope_dim)), "kv_down": (d_model, kv_latent_dim),
              "k_up": (kv_latent_dim, num_heads * head_dim), "v_up": (kv_latent_dim, num_heads * head_dim),
              "k_rope": (d_model, rope_dim), "o_proj": (num_heads * head_dim, d_model)}
    if rope_dim == 0:
        del shapes["k_rope"]
    return shapes


def sizes_of(inputs: Inputs) -> tuple[int, int, int, int, int]:
    return tuple(inputs[k] for k in ("d_model", "num_heads", "head_dim", "kv_latent_dim", "rope_dim"))


@adapter
def structure(functions, inputs: Inputs) -> dict:
    sizes, base = sizes_of(inputs), inputs["rope_base"]
    keyword = {} if base is None else {"rope_base": base}
    module = functions.MultiHeadLatentAttention(*sizes, **keyword)
    call = f"MultiHeadLatentAttention({', '.join(map(str, sizes))}{options_text(keyword)})"
    return structure_of(module, call, LAYERS, ("num_heads", "head_dim", "kv_latent_dim", "rope_dim", "rope_base"))


def build_module(functions, inputs: Inputs) -> nn.Module:
    """The learner's module holding the case's weights, in the dtype of `x`."""
    sizes, base = sizes_of(inputs), inputs["rope_base"]
    module = functions.MultiHeadLatentAttention(*sizes, **({} if base is None else {"rope_base": base}))
    module = learner_module(module, "MultiHeadLatentAttention").to(inputs["x"].dtype)
    shapes = layer_shapes(*sizes)
    expected = {name: linear_text(*shapes[name], bias=False) if name in shapes else "None" for name in LAYERS}
    load_layers(module, "MultiHeadLatentAttention", expected, inputs)
    return module


attention = module_attention(build_module)


def given_module(inputs: Inputs) -> SimpleNamespace:
    """The projections holding the case's weights (k_rope None when rope_dim is 0), the ints and rope_base."""
    d_model, num_heads, head_dim, kv_latent_dim, rope_dim = sizes_of(inputs)
    layers = {"k_rope": None}
    for name, (in_features, out_features) in layer_shapes(*sizes_of(inputs)).items():
        weight = inputs[f"{name}.weight"]
        layer = nn.Linear(in_features, out_features, bias=False, dtype=weight.dtype).requires_grad_(False)
        layer.weight.copy_(weight)
        layers[name] = layer
    base = DEFAULT_BASE if inputs["rope_base"] is None else inputs["rope_base"]
    return SimpleNamespace(**layers, num_heads=num_heads, head_dim=head_dim, kv_latent_dim=kv_latent_dim,
                           rope_dim=rope_dim, rope_base=base)


def given_cache(inputs: Inputs):
    return (inputs["cache_latent"], inputs["cache_rope_keys"]) if "cache_latent" in inputs.values else None


@adapter
def decode(functions, inputs: Inputs) -> dict:
    """Feed `x` through mla_decode_step in each chunking; the outputs joined and the cache at the end."""
    module, x, given = given_module(inputs), inputs["x"], given_cache(inputs)
    cached = 0 if given is None else given[0].shape[1]
    batch = x.shape[0]
    shapes = lambda tokens: ((batch, tokens, module.kv_latent_dim), (batch, tokens, module.rope_dim))  # noqa: E731
    return decoded(functions.mla_decode_step, STEP, module, x, inputs["chunkings"], given, cached,
                   ("latent", "rope_keys"), shapes)


def memory_bounds(inputs: Inputs) -> dict:
    """The contract's bound for one new token after a cache of t, and the size of the keys expanded per head."""
    d_model, num_heads, head_dim, kv_latent_dim, rope_dim = sizes_of(inputs)
    batch, t = inputs["x"].shape[0], inputs["cache_latent"].shape[1]
    weights = max(a * b for a, b in layer_shapes(*sizes_of(inputs)).values())
    limit = max(batch * num_heads * (t + 1) * 2, batch * num_heads * max(kv_latent_dim, head_dim + rope_dim),
                batch * (t + 1) * (kv_latent_dim + rope_dim), weights)
    expanded = batch * (t + 1) * num_heads * head_dim
    return {LIMIT: limit, EXPANDED: expanded, EXPANSION_FLOPS: 2 * expanded * kv_latent_dim}


@adapter
def decode_memory(functions, inputs: Inputs) -> dict:
    """One new token after the given cache, the largest tensor created during the step measured."""
    module, x, cache = given_module(inputs), inputs["x"], given_cache(inputs)
    with measure.Footprint() as footprint, measure.MatmulFlops() as counted:
        out, cache = pair(functions.mla_decode_step(module, x, cache), "mla_decode_step(module, x_new, cache)",
                          "(out, (latent, rope_keys))")
    return {"out": out, LARGEST: footprint.largest, COMPUTED: footprint.produced, FLOPS: counted.matmul_flops,
            **memory_bounds(inputs)}


cache_sizes = byte_counts("mla_cache_bytes")


EXERCISE = Exercise(
    id="mla",
    assignment="latent",
    title="Multi-head latent attention (DeepSeek-V2)",
    required=(MODULE, STEP, BYTES),
    not_allowed=NOT_ALLOWED_ATTENTION,
    rules_in_process=True,
)
