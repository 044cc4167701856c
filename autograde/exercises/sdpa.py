"""`sdpa`: scaled dot-product attention and the bottom-right aligned causal mask.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_sdpa.py`.
"""

from __future__ import annotations

import torch

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, Exercise, Inputs
from autograde.observe import ContractError, pair

ATTENTION = "scaled_dot_product_attention"
CAUSAL = "causal_mask"


def call_text(inputs: Inputs) -> str:
    return "scaled_dot_product_attention(q, k, v" + (", mask=mask)" if "mask" in inputs.values else ")")


@adapter
def attend(functions, inputs: Inputs) -> dict:
    mask = {"mask": inputs["mask"]} if "mask" in inputs.values else {}
    out, weights = pair(functions.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], **mask),
                        call_text(inputs))
    return {"out": out, "weights": weights}


@adapter
def gradients(functions, inputs: Inputs) -> dict:
    """The gradients of (out * dout).sum() with respect to q, k and v, computed where the learner's code runs."""
    q, k, v = (inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    mask = {"mask": inputs["mask"]} if "mask" in inputs.values else {}
    out, _ = pair(functions.scaled_dot_product_attention(q, k, v, **mask), call_text(inputs))
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ContractError(f"{call_text(inputs)} returned an `out` that autograd cannot trace back to q, k and v")
    (out * inputs["dout"]).sum().backward()
    return {"q.grad": q.grad, "k.grad": k.grad, "v.grad": v.grad}


@adapter
def causal_masks(functions, inputs: Inputs) -> dict:
    """causal_mask(*args) for each of `calls`, and causal_mask(*args, device=...) for each of `device_calls`."""
    masks = {f"causal_mask({', '.join(map(repr, args))})": functions.causal_mask(*args) for args in inputs["calls"]}
    for args in inputs.get("device_calls", []):
        masks[f"causal_mask({', '.join(map(repr, args))}, device={inputs['device']!r})"] = functions.causal_mask(
            *args, device=inputs["device"])
    return masks


EXERCISE = Exercise(
    id="sdpa",
    assignment="attention",
    title="Scaled dot-product attention",
    required=(ATTENTION, CAUSAL),
    not_allowed=NOT_ALLOWED_ATTENTION,
)
