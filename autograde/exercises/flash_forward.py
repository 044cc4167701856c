"""`flash_forward`: the online softmax and the tiled (FlashAttention) forward pass.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_flash_forward.py`.
"""

from __future__ import annotations

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX, Exercise, Inputs
from autograde.observe import pair
from autograde.rules import measure

ONLINE, FORWARD = "online_softmax", "flash_attention_forward"
OPTIONS = ("causal", "block_q", "block_k")
DEFAULT_BLOCK = 64


WORK_LENGTH, WORK_BLOCK, WORK_RATIO = 1024, 64, 0.6


WIDEST, BLOCK_LIMIT = measure.reduction_keys(ONLINE)
LARGEST, MEMORY_LIMIT = measure.memory_keys(FORWARD)
WIDEST_OVER_KEYS, KEYS_LIMIT = measure.keys_in_blocks_keys(FORWARD)
CAUSAL_FLOPS, FULL_FLOPS, RATIO_ALLOWED = measure.work_keys()


def call_text(function: str, arguments: str, options: dict) -> str:
    return f"{function}({arguments}{''.join(f', {name}={value!r}' for name, value in options.items())})"


def options_of(inputs: Inputs) -> dict:
    return {name: inputs[name] for name in OPTIONS if name in inputs.values}


def memory_limit(inputs: Inputs) -> int:
    """max(q.numel(), k.numel(), v.numel(), B*H*block_q*block_k), the memory rule's bound."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    B, H = q.shape[:2]
    block_q, block_k = inputs.get("block_q", DEFAULT_BLOCK), inputs.get("block_k", DEFAULT_BLOCK)
    return max(q.numel(), k.numel(), v.numel(), B * H * block_q * block_k)


def forward_call(functions, inputs: Inputs, **override) -> tuple:
    options = {**options_of(inputs), **override}
    result = functions.flash_attention_forward(inputs["q"], inputs["k"], inputs["v"], **options)
    return pair(result, call_text(FORWARD, "q, k, v", options), "(out, lse)")


@adapter
def softmaxes(functions, inputs: Inputs) -> dict:
    return {f"online_softmax(x, {size})": functions.online_softmax(inputs["x"], size) for size in inputs["block_sizes"]}


@adapter
def softmax_reductions(functions, inputs: Inputs) -> dict:
    with measure.Reductions() as reductions:
        functions.online_softmax(inputs["x"], inputs["block_size"])
    return {WIDEST: reductions.widest, f"{WIDEST} (call)": reductions.widest_call, BLOCK_LIMIT: inputs["block_size"]}


@adapter
def forward(functions, inputs: Inputs) -> dict:
    out, lse = forward_call(functions, inputs)
    return {"out": out, "lse": lse}


@adapter
def forward_memory(functions, inputs: Inputs) -> dict:
    with measure.Footprint() as footprint, measure.Reductions() as reductions:
        out, lse = forward_call(functions, inputs)
    return {"out": out, "lse": lse, LARGEST: footprint.largest, MEMORY_LIMIT: memory_limit(inputs),
            WIDEST_OVER_KEYS: reductions.widest, f"{WIDEST_OVER_KEYS} (call)": reductions.widest_call,
            KEYS_LIMIT: max(inputs.get("block_k", DEFAULT_BLOCK), inputs["q"].shape[-1])}


@adapter
def forward_work(functions, inputs: Inputs) -> dict:
    flops = {}
    for causal in (False, True):
        with measure.MatmulFlops() as counted:
            out, lse = forward_call(functions, inputs, causal=causal)
        flops[causal] = counted.matmul_flops
    return {"out": out, "lse": lse, CAUSAL_FLOPS: flops[True], FULL_FLOPS: flops[False], RATIO_ALLOWED: WORK_RATIO}


EXERCISE = Exercise(
    id="flash_forward",
    assignment="flash",
    title="Online softmax and the tiled forward pass",
    required=(ONLINE, FORWARD),
    not_allowed=NOT_ALLOWED_ATTENTION + NOT_ALLOWED_SOFTMAX,
    rules_in_process=True,
)
