"""`flash_triton`: the tiled forward pass as a Triton kernel.

The exercise and the calls its tests make on a submission (adapters), run in the learner's
process when a notebook is graded; its tests, and the inputs they draw, are in
`autograde/tests/test_flash_triton.py`.
"""

from __future__ import annotations

import os

import torch

from autograde.adapters import adapter
from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX, Exercise, Inputs
from autograde.observe import ContractError, pair
from autograde.rules import measure

TRITON = "flash_attention_triton"
# The one thing loading the exercises does beyond defining them. Triton chooses to interpret when
# it is first imported, and decorates its own library then. This process may run a kernel (a
# learner's `check()`, the release's recording of the solution), so it chooses now, before anything
# imports Triton (`torch.utils.flop_counter` does): interpreted without a CUDA GPU. The fork server and the
# worker are told through the exercise's `env`, so that the fork server never asks the driver,
# whose threads would make its forks unsafe.
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
INTERPRET = {"TRITON_INTERPRET": os.environ["TRITON_INTERPRET"]}
LAUNCHES, WRITTEN, OUTSIDE = measure.launched_keys(TRITON)


def on_device() -> str:
    return "cpu" if INTERPRET["TRITON_INTERPRET"] == "1" else "cuda"


@adapter
def triton_attention(functions, inputs: Inputs) -> dict:
    device = on_device()
    # float32 on both sides: the reference receives the inputs in float64, but its kernel, like
    # the learner's, keeps float32 accumulators, made for float16 and float32 inputs.
    q, k, v = (inputs[name].to(device=device, dtype=torch.float32) for name in ("q", "k", "v"))
    with measure.Reductions() as outside, measure.TritonLaunches() as launches:
        result = functions.flash_attention_triton(q, k, v, causal=inputs["causal"])
    out, lse = pair(result, f"{TRITON}(q, k, v, causal={inputs['causal']!r})", "(out, lse)")
    written = [name for name, tensor in (("out", out), ("lse", lse))
               if isinstance(tensor, torch.Tensor) and launches.wrote(tensor)]
    for name, tensor in (("out", out), ("lse", lse)):
        if isinstance(tensor, torch.Tensor) and tensor.device.type != device:
            raise ContractError(f"`{name}` is on {tensor.device.type}; it should be on {device}, with q")
    # Observed on the CPU, where the expected values are.
    return {"out": out.cpu() if isinstance(out, torch.Tensor) else out,
            "lse": lse.cpu() if isinstance(lse, torch.Tensor) else lse, LAUNCHES: launches.count,
            WRITTEN: " and ".join(written) or "neither",
            OUTSIDE: outside.widest, f"{OUTSIDE} (call)": outside.widest_call}


EXERCISE = Exercise(
    id="flash_triton",
    assignment="flash",
    title="FlashAttention forward in Triton",
    required=(TRITON,),
    not_allowed=NOT_ALLOWED_ATTENTION + NOT_ALLOWED_SOFTMAX,
    env=INTERPRET,
    gpu=True,  # compiled kernels run on the GPU where there is one
    rules_in_process=True,
)
