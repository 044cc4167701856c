"""The reference solutions agree with PyTorch's own attention: an oracle that is not the course's code.

The contract differs from PyTorch in two places, applied here to PyTorch's side: a query row
with every key masked gets weights 0 and output 0 (nn.MultiheadAttention gives NaN), and
nn.MultiheadAttention's `attn_mask` means True = blocked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autograde import registry as exercises
from autograde import solutions

pytestmark = pytest.mark.timeout(120)

SDPA = solutions.namespace(exercises.get("sdpa"))
MHA = solutions.namespace(exercises.get("mha"))


def random_mask(generator, shape, empty_rows=0):
    mask = torch.rand(shape, generator=generator) < 0.6
    mask[..., 0] = True
    rows = mask.view(-1, shape[-1])
    rows[:empty_rows] = False
    return mask


def pytorch_attention(q, k, v, mask):
    """out and weights from F.scaled_dot_product_attention; the weights are its output for v = identity."""
    S = k.shape[-2]
    identity = torch.eye(S, dtype=q.dtype).expand(*k.shape[:-2], S, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    weights = F.scaled_dot_product_attention(q, k, identity, attn_mask=mask)
    if mask is not None:
        empty = ~mask.any(dim=-1, keepdim=True)
        out, weights = out.masked_fill(empty, 0.0), weights.masked_fill(empty, 0.0)
    return out, weights


ATTENTION_CASES = [
    # lead dims, L, S, d_k, d_v, mask shape (None: no mask), rows with every key masked
    ((2, 3), 4, 6, 8, 5, None, 0),
    ((3,), 5, 5, 16, 16, (5, 5), 0),
    ((2, 4), 5, 3, 8, 2, (2, 1, 5, 3), 2),
    ((1, 2), 1, 7, 4, 4, (1, 2, 1, 7), 1),
    ((2, 2), 6, 2, 4, 3, (2, 1, 1, 2), 0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lead, L, S, d_k, d_v, mask_shape, empty_rows", ATTENTION_CASES)
def test_reference_attention_agrees_with_torch_sdpa(lead, L, S, d_k, d_v, mask_shape, empty_rows, dtype):
    generator = torch.Generator().manual_seed(L * 100 + S)
    q, k = (torch.randn(*lead, n, d_k, generator=generator, dtype=dtype) for n in (L, S))
    v = torch.randn(*lead, S, d_v, generator=generator, dtype=dtype)
    mask = None if mask_shape is None else random_mask(generator, mask_shape, empty_rows)
    out, weights = SDPA["scaled_dot_product_attention"](q, k, v, mask)
    expected_out, expected_weights = pytorch_attention(q, k, v, mask)
    assert out.dtype == weights.dtype == dtype
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)
    assert not out.isnan().any()


@pytest.mark.parametrize("L, S", [(1, 1), (4, 4), (3, 6), (6, 3), (1, 5), (5, 1), (7, 2)])
def test_reference_causal_mask_is_bottom_right_aligned(L, S):
    mask = SDPA["causal_mask"](L, S)
    expected = np.tri(L, S, k=S - L, dtype=bool)  # numpy's triangle: 1 where j <= i + (S - L)
    assert mask.dtype == torch.bool
    np.testing.assert_array_equal(mask.numpy(), expected)
    np.testing.assert_array_equal(SDPA["causal_mask"](L).numpy(), np.tri(L, L, dtype=bool))


def test_reference_causal_attention_matches_torch_is_causal_for_square_inputs():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    out, _ = SDPA["scaled_dot_product_attention"](q, k, v, SDPA["causal_mask"](6))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_reference_split_heads_matches_numpy():
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    expected = x.numpy().reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(MHA["split_heads"](x, 3).numpy(), expected)
    torch.testing.assert_close(MHA["merge_heads"](MHA["split_heads"](x, 3)), x, rtol=0, atol=0)


MHA_CASES = [
    # d_model, heads, bias, batch, L, S, mask: None, "2d" (L, S) or "padding" (B, S), empty rows
    (16, 4, True, 2, 5, 5, None, 0),
    (12, 3, False, 2, 4, 6, None, 0),
    (12, 3, True, 3, 4, 6, "2d", 1),
    (8, 2, True, 2, 3, 5, "padding", 0),
    (8, 8, False, 1, 6, 2, "2d", 2),
    (6, 1, True, 2, 1, 3, None, 0),
]


@pytest.mark.parametrize("d_model, heads, bias, B, L, S, mask_kind, empty_rows", MHA_CASES)
def test_reference_module_agrees_with_nn_multiheadattention(d_model, heads, bias, B, L, S, mask_kind, empty_rows):
    torch.manual_seed(d_model * 10 + heads)
    torch_mha = nn.MultiheadAttention(d_model, heads, bias=bias, batch_first=True).double()
    if bias:  # PyTorch starts its biases at 0, which would hide a bias copied to the wrong place
        with torch.no_grad():
            torch_mha.in_proj_bias.normal_()
            torch_mha.out_proj.bias.normal_()
    module = MHA["MultiHeadAttention"](d_model, heads, bias=bias).double()
    assert MHA["load_torch_mha"](module, torch_mha) is module
    query = torch.randn(B, L, d_model, dtype=torch.float64)
    key, value = torch.randn(B, S, d_model, dtype=torch.float64), torch.randn(B, S, d_model, dtype=torch.float64)

    torch_kwargs, mask = {}, None
    if mask_kind == "2d":
        mask = random_mask(torch.Generator().manual_seed(1), (L, S), empty_rows)
        torch_kwargs["attn_mask"] = ~mask  # nn.MultiheadAttention: True = blocked
    elif mask_kind == "padding":
        padding = torch.ones(B, S, dtype=torch.bool)
        padding[0, -2:] = False
        mask = padding[:, None, None, :]
        torch_kwargs["key_padding_mask"] = ~padding
    with torch.no_grad():
        out, weights = module(query, key, value, mask=mask)
        expected_out, expected_weights = torch_mha(query, key, value, average_attn_weights=False, **torch_kwargs)
    if mask is not None:
        empty = ~torch.broadcast_to(mask, (B, 1, L, S)).any(dim=-1)[:, 0]  # (B, L)
        zero_attention = torch_mha.out_proj(torch.zeros(d_model, dtype=torch.float64))
        expected_out = torch.where(empty[..., None], zero_attention, expected_out)
        expected_weights = expected_weights.masked_fill(empty[:, None, :, None], 0.0)
    assert out.shape == (B, L, d_model) and weights.shape == (B, heads, L, S)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)


def test_reference_module_has_the_contract_structure():
    for bias in (True, False):
        module = MHA["MultiHeadAttention"](16, 4, bias=bias)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            layer = getattr(module, name)
            assert isinstance(layer, nn.Linear)
            assert (layer.in_features, layer.out_features, layer.bias is not None) == (16, 16, bias)
    with pytest.raises(ValueError):
        MHA["MultiHeadAttention"](10, 3)
    with pytest.raises(ValueError):
        MHA["split_heads"](torch.zeros(1, 2, 10), 3)
