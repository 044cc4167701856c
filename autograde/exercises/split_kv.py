"""`split_kv`: split-KV decoding (FlashDecoding): merging the attention of two key sets, and attention

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_split_kv.py`.
"""

from __future__ import annotations

import math

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX, Exercise, Inputs
from autograde.observe import ContractError, kind_of, pair

MERGE, SPLIT = "merge_attention_states", "split_kv_attention"
RESULTS = ("out", "lse", "partial_out", "partial_lse")


def chunk_bounds(length: int, num_splits: int) -> list[tuple[int, int]]:
    """The contract's chunks: ceil(S / num_splits) keys each, the last ones shorter or empty."""
    size = math.ceil(length / num_splits)
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(num_splits)]


def chunks_text(length: int, num_splits: int) -> str:
    return "+".join(str(stop - start) for start, stop in chunk_bounds(length, num_splits))


@adapter
def merges(functions, inputs: Inputs) -> dict:
    """merge_attention_states on each set of states of the case (`tag`: the suffix of their names)."""
    outputs = {}
    for tag in inputs["tags"]:
        names = [f"{name}{tag}" for name in ("out_a", "lse_a", "out_b", "lse_b")]
        call = f"{MERGE}({', '.join(names)})"
        out, lse = pair(functions.merge_attention_states(*(inputs[name].clone() for name in names)), call,
                        "(out, lse)")
        outputs[f"{call}: out"], outputs[f"{call}: lse"] = out, lse
    return outputs


@adapter
def splits(functions, inputs: Inputs) -> dict:
    """split_kv_attention on each (keys, num_splits, causal) of the case: its four results."""
    outputs = {}
    for keys, num_splits, causal in inputs["calls"]:
        k, v = inputs[f"k{keys}"], inputs[f"v{keys}"]
        options = ", causal=True" if causal else ""
        call = f"{SPLIT}(q, k{keys}, v{keys}, {num_splits}{options})"
        arguments = (inputs["q"].clone(), k.clone(), v.clone(), num_splits)
        result = functions.split_kv_attention(*arguments, causal=True) if causal else \
            functions.split_kv_attention(*arguments)
        if not (isinstance(result, (tuple, list)) and len(result) == 4):
            raise ContractError(f"{call} must return four values (out, lse, partial_out, partial_lse); "
                                f"it returned {kind_of(result)}")
        label = f"{call} (chunks of {chunks_text(k.shape[2], num_splits)} keys)"
        for name, value in zip(RESULTS, result):
            outputs[f"{label}: {name}"] = value
    return outputs


EXERCISE = Exercise(
    id="split_kv",
    assignment="decoding",
    title="Split-KV decoding (FlashDecoding)",
    required=(MERGE, SPLIT),
    not_allowed=NOT_ALLOWED_ATTENTION + NOT_ALLOWED_SOFTMAX,
)
