"""`paged_kv`: a paged KV cache: appending a token through the block table, in place, and attention of

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_paged_kv.py`.
"""

from __future__ import annotations

import torch

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.observe import ContractError, kind_of

APPEND, ATTENTION = "append_to_paged_cache", "paged_attention"
CACHE = ("k_pages", "v_pages", "block_table", "seq_lens")
WRITTEN = ("keys in the new slots", "values in the new slots")
ELSEWHERE = ("k_pages outside the new slots", "v_pages outside the new slots", "block_table after the call",
             "seq_lens after the call")


def checked_tensor(value, call: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ContractError(f"{call} returned {kind_of(value)}, not a tensor")
    if tuple(value.shape) != shape:
        raise ContractError(f"{call} returned a tensor of shape {tuple(value.shape)}; expected {shape}")
    return value


def new_slots(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The page and the slot of position seq_lens[b] of each sequence b."""
    page_size, lengths = inputs["k_pages"].shape[2], inputs["seq_lens"]
    return inputs["block_table"][torch.arange(len(lengths)), lengths // page_size], lengths % page_size


@adapter
def appended(functions, inputs: Inputs) -> dict:
    """append_to_paged_cache on copies of the case's cache: the new slots, and everything else, after the call."""
    k_pages, v_pages, table, lengths = (inputs[name].clone() for name in CACHE)
    functions.append_to_paged_cache(k_pages, v_pages, table, lengths, inputs["k_new"].clone(),
                                    inputs["v_new"].clone())
    pages, slots = new_slots(inputs)
    kept = torch.ones(k_pages.shape[0], 1, k_pages.shape[2], 1, dtype=torch.bool)
    kept[pages, 0, slots] = False
    return dict(zip(WRITTEN + ELSEWHERE, (k_pages[pages, :, slots], v_pages[pages, :, slots],
                                          torch.where(kept, k_pages, 0.0), torch.where(kept, v_pages, 0.0),
                                          table, lengths)))


@adapter
def attended(functions, inputs: Inputs) -> dict:
    arguments = {name: inputs[name].clone() for name in ("q", *CACHE)}
    out = functions.paged_attention(*arguments.values())
    kept = all(torch.equal(value, inputs[name]) for name, value in arguments.items())
    return {"out": out, "paged_attention(q, k_pages, v_pages, block_table, seq_lens) leaves them unchanged": kept}


@adapter
def decoded(functions, inputs: Inputs) -> dict:
    """At each step: append the step's token to every sequence, count it, and attend with the step's query."""
    k_pages, v_pages, table, lengths = (inputs[name].clone() for name in CACHE)
    steps, batch, heads, width = inputs["q"].shape
    outputs = []
    for step in range(steps):
        functions.append_to_paged_cache(k_pages, v_pages, table, lengths, inputs["k_new"][step].clone(),
                                        inputs["v_new"][step].clone())
        lengths = lengths + 1  # the caller's count: append_to_paged_cache leaves seq_lens as it is
        out = functions.paged_attention(inputs["q"][step].clone(), k_pages, v_pages, table, lengths)
        outputs.append(checked_tensor(out, f"paged_attention(q[{step}], ...) after step {step}",
                                      (batch, heads, width)))
    return {"out at each step": torch.stack(outputs), "k_pages at the end": k_pages, "v_pages at the end": v_pages}


EXERCISE = Exercise(
    id="paged_kv",
    assignment="decoding",
    title="A paged KV cache",
    required=(APPEND, ATTENTION),
    not_allowed=NOT_ALLOWED_ATTENTION,
)
