"""`flash_backward`: the tiled backward pass, and FlashAttention as an autograd Function.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_flash_backward.py`.
"""

from __future__ import annotations

import torch

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX, Exercise, Inputs
from autograde.exercises.flash_forward import FORWARD, call_text, memory_limit, options_of
from autograde.observe import ContractError, kind_of
from autograde.rules import measure

BACKWARD, FUNCTION = "flash_attention_backward", "FlashAttention"
LARGEST, MEMORY_LIMIT = measure.memory_keys(BACKWARD)
SAVED = measure.saved_key(FUNCTION)
RECORDED, APPLY_RECORDED = measure.by_hand_key(BACKWARD), measure.by_hand_key(f"{FUNCTION}'s backward")


def gradients(result, call: str) -> tuple:
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise ContractError(f"{call} must return a triple (dq, dk, dv); it returned {kind_of(result)}")
    return tuple(result)


def apply_function(functions, inputs: Inputs) -> tuple:
    """q, k, v as leaves that require grad, and FlashAttention.apply's output on them."""
    q, k, v = (inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    out = functions.FlashAttention.apply(q, k, v, inputs["causal"])
    if not isinstance(out, torch.Tensor):
        raise ContractError(f"FlashAttention.apply(q, k, v, causal) must return out; it returned {kind_of(out)}")
    return q, k, v, out


@adapter
def backward(functions, inputs: Inputs) -> dict:
    options = options_of(inputs)
    tensors = [inputs[name] for name in ("q", "k", "v", "out", "lse", "dout")]
    call = call_text(BACKWARD, "q, k, v, out, lse, dout", options)
    dq, dk, dv = gradients(functions.flash_attention_backward(*tensors, **options), call)
    return {"dq": dq, "dk": dk, "dv": dv}


@adapter
def backward_memory(functions, inputs: Inputs) -> dict:
    with measure.Footprint() as footprint, measure.AutogradRecorded() as recorded:
        observed = backward(functions, inputs)
    return {**observed, LARGEST: footprint.largest, MEMORY_LIMIT: memory_limit(inputs), RECORDED: recorded.saved}


@adapter
def apply_gradients(functions, inputs: Inputs) -> dict:
    q, k, v, out = apply_function(functions, inputs)
    loss = (out * inputs["dout"]).sum()
    with measure.AutogradRecorded() as recorded:  # the backward alone: the product above saves dout
        loss.backward()
    return {"out": out, "q.grad": q.grad, "k.grad": k.grad, "v.grad": v.grad, APPLY_RECORDED: recorded.saved}


@adapter
def saved_tensors(functions, inputs: Inputs) -> dict:
    q, k, v, out = apply_function(functions, inputs)
    known = {"q": q, "k": k, "v": v, "out": out, "lse": inputs["lse"]}
    return {"out": out, SAVED: measure.saved_for_backward(out, known)}


EXERCISE = Exercise(
    id="flash_backward",
    assignment="flash",
    title="The tiled backward pass",
    required=(FORWARD, BACKWARD, FUNCTION),
    not_allowed=NOT_ALLOWED_ATTENTION + NOT_ALLOWED_SOFTMAX,
    rules_in_process=True,
)
