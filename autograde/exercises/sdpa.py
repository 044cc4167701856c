"""`sdpa`: scaled dot-product attention and the bottom-right aligned causal mask."""

from __future__ import annotations

import torch

from autograde.cases import NOT_ALLOWED_ATTENTION, Case, Draw, Exercise, Inputs
from autograde.observe import pair

ATTENTION = "scaled_dot_product_attention"
CAUSAL = "causal_mask"


def random_mask(draw: Draw, shape: tuple[int, ...], empty_rows: int = 0) -> tuple[torch.Tensor, str]:
    """A bool mask (True = may attend) in which exactly `empty_rows` rows attend nothing, and a note."""
    mask = draw.bernoulli(*shape, p=0.6)
    rows = mask.view(-1, shape[-1])
    for row in rows:  # every row keeps at least one key, unless chosen to be empty below
        row[draw.integer(0, shape[-1] - 1)] = True
    emptied = draw.py.sample(range(rows.shape[0]), empty_rows)
    rows[emptied] = False
    return mask, plural(empty_rows, "fully masked row") if empty_rows else "no row fully masked"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def bottom_right_causal(L: int, S: int) -> torch.Tensor:
    return torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)


def qkv(draw: Draw, lead: tuple[int, ...], L: int, S: int, d_k: int, d_v: int, dtype, scale=1.0) -> dict:
    return {
        "q": draw.normal(*lead, L, d_k, dtype=dtype, scale=scale),
        "k": draw.normal(*lead, S, d_k, dtype=dtype, scale=scale),
        "v": draw.normal(*lead, S, d_v, dtype=dtype),
    }


def attend(functions, inputs: Inputs) -> dict:
    mask = {"mask": inputs["mask"]} if "mask" in inputs.values else {}
    call = "scaled_dot_product_attention(q, k, v" + (", mask=mask)" if mask else ")")
    out, weights = pair(functions.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], **mask), call)
    return {"out": out, "weights": weights}


def causal_masks(functions, inputs: Inputs) -> dict:
    return {
        f"causal_mask({', '.join(map(repr, args))})": functions.causal_mask(*args)
        for args in inputs["calls"]
    }


# Visible cases.

def no_mask(draw: Draw) -> Inputs:
    return Inputs(qkv(draw, (2, 3), L=4, S=6, d_k=8, d_v=5, dtype=torch.float64), "no mask, L != S, d_v != d_k")


def float32(draw: Draw) -> Inputs:
    return Inputs(qkv(draw, (2, 2), L=5, S=7, d_k=16, d_v=16, dtype=torch.float32, scale=2.0), "no mask")


def broadcast_mask(draw: Draw) -> Inputs:
    values = qkv(draw, (2, 4), L=5, S=6, d_k=8, d_v=8, dtype=torch.float64)
    values["mask"], note = random_mask(draw, (5, 6))
    return Inputs(values, f"mask broadcast over batch and heads, {note}")


def fully_masked_rows(draw: Draw) -> Inputs:
    values = qkv(draw, (2, 3), L=4, S=6, d_k=8, d_v=4, dtype=torch.float32)
    values["mask"], note = random_mask(draw, (2, 1, 4, 6), empty_rows=2)
    return Inputs(values, f"mask broadcast over heads, {note}")


def square_causal(draw: Draw) -> Inputs:
    return Inputs({"calls": [(5,), (1,), (4, None, "cpu")]}, "L == S")


def rectangular_causal(draw: Draw) -> Inputs:
    return Inputs({"calls": [(3, 6), (6, 3), (1, 4), (4, 1)]}, "L < S and L > S")


# Hidden cases: shapes, dtypes and masks drawn from the instructor's seed.

def random_shapes(draw: Draw) -> Inputs:
    lead = (draw.integer(1, 3),) if draw.integer(0, 1) else (draw.integer(1, 3), draw.integer(1, 4))
    dtype = draw.choice([torch.float32, torch.float64])
    values = qkv(draw, lead, L=draw.integer(1, 9), S=draw.integer(1, 9),
                 d_k=draw.integer(1, 16), d_v=draw.integer(1, 16), dtype=dtype, scale=draw.choice([0.5, 1.0, 3.0]))
    return Inputs(values, "no mask, random sizes")


def random_masks(draw: Draw) -> Inputs:
    B, H, L, S = draw.integer(1, 3), draw.integer(1, 4), draw.integer(2, 8), draw.integer(2, 8)
    values = qkv(draw, (B, H), L=L, S=S, d_k=draw.integer(2, 12), d_v=draw.integer(1, 12),
                 dtype=draw.choice([torch.float32, torch.float64]))
    shape = draw.choice([(L, S), (B, 1, L, S), (B, H, L, S), (1, H, L, S)])
    values["mask"], note = random_mask(draw, shape, empty_rows=draw.integer(1, 2))
    return Inputs(values, f"random mask, {note}")


def causal_attention(draw: Draw) -> Inputs:
    S = draw.integer(1, 6)
    L = S + draw.integer(1, 4)
    values = qkv(draw, (draw.integer(1, 3), draw.integer(1, 3)), L=L, S=S, d_k=8, d_v=8, dtype=torch.float64)
    values["mask"] = bottom_right_causal(L, S)
    return Inputs(values, f"causal mask with L > S: the first {plural(L - S, 'row')} attend nothing")


def random_causal(draw: Draw) -> Inputs:
    calls = [(draw.integer(1, 12), draw.integer(1, 12)) for _ in range(4)] + [(draw.integer(1, 12),)]
    return Inputs({"calls": calls}, "random L and S")


EXERCISE = Exercise(
    id="sdpa",
    assignment="attention",
    title="Scaled dot-product attention",
    required=(ATTENTION, CAUSAL),
    not_allowed=NOT_ALLOWED_ATTENTION,
    cases=(
        Case("no-mask", 1.5, True, "outputs and weights without a mask", (ATTENTION,), no_mask, attend),
        Case("float32", 1.0, True, "float32 in, float32 out", (ATTENTION,), float32, attend),
        Case("broadcast-mask", 1.0, True, "an (L, S) mask broadcast to every batch and head",
             (ATTENTION,), broadcast_mask, attend),
        Case("fully-masked-rows", 1.0, True, "rows with every key masked give weights 0 and output 0",
             (ATTENTION,), fully_masked_rows, attend),
        Case("causal-mask-square", 0.5, True, "causal_mask(L) is the lower triangle", (CAUSAL,),
             square_causal, causal_masks),
        Case("causal-mask-rectangular", 1.0, True, "causal_mask(L, S) is bottom-right aligned",
             (CAUSAL,), rectangular_causal, causal_masks),
        Case("random-shapes", 1.5, False, "random batch shapes, sizes and dtypes", (ATTENTION,),
             random_shapes, attend),
        Case("random-masks", 1.0, False, "random broadcast masks with fully masked rows", (ATTENTION,),
             random_masks, attend),
        Case("causal-attention", 1.0, False, "a causal mask with more queries than keys", (ATTENTION,),
             causal_attention, attend),
        Case("causal-mask-random", 0.5, False, "causal_mask for random L and S", (CAUSAL,),
             random_causal, causal_masks),
    ),
)
