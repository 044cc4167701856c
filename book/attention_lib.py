"""The course's library: the definitions of the chapters' cells tagged `library`.

Written by tools/course_library.py at every build of the book, from the chapters named
above each definition: change the chapter, not this file.
"""

import math
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


# book/attention-as-soft-lookup.md

def attention(q, k, v, mask=None):
    """Scaled dot-product attention.

    q (..., L, d_k), k (..., S, d_k), v (..., S, d_v); mask bool, broadcastable to
    (..., L, S), True where a query may attend a key. A query with no visible key gets
    weights 0 and output 0.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        scores = scores.masked_fill(~mask, float("-inf"))
        # softmax of an all -inf row is 0/0 = NaN, in the forward and the backward pass.
        has_key = mask.any(dim=-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1).masked_fill(~has_key, 0.0)
    return weights @ v, weights


def causal_mask(L, S=None, device=None):
    """Bool (L, S), True where query i may attend key j, i.e. j <= i + (S - L)."""
    S = L if S is None else S
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=S - L)


# book/memory-bound.md

def naive_attention(q, k, v, causal=False):
    """Attention through the full (L, S) score matrix: (output, logsumexp of each row)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], device=q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    # A row that sees no key has lse = -inf, and exp(-inf - (-inf)) is NaN: subtract 0 there.
    weights = torch.exp(scores - lse.masked_fill(lse == -math.inf, 0.0))
    return weights @ v, lse.squeeze(-1)


# book/tiled-forward.md

class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor returned by an operator inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return result


# book/attention-variants.md

def full_attention(q, k, v, mask=None):
    """The output of `attention` (q, k, v of shape (..., N, d); mask broadcasts to (..., L, S))."""
    return attention(q, k, v, mask)[0]


def max_error(a, b):
    return (a - b).abs().max().item()


def relative_error(approx, exact):
    return ((approx - exact).norm() / exact.norm()).item()


def cpu_seconds(fn):
    """Run fn once on one thread; return its result and the CPU seconds it took."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.process_time()
        result = fn()
        return result, time.process_time() - start
    finally:
        torch.set_num_threads(threads)


def best_time(fn, budget=0.2):
    """CPU seconds of one call on one thread: the fastest of 2 to 10 calls after a warm-up."""
    _, first = cpu_seconds(fn)
    repeats = min(10, max(2, int(budget / max(first, 1e-6))))
    return min(cpu_seconds(fn)[1] for _ in range(repeats))


def largest_tensor(fn):
    with LargestTensor() as record:
        cpu_seconds(fn)
    return record.numel


def positions(n):
    index = torch.arange(n)
    return index[:, None], index[None, :]  # query i down the rows, key j along the columns


def causal_pattern(n):
    i, j = positions(n)
    return j <= i


def window_pattern(n, radius):
    i, j = positions(n)
    return (i - j).abs() <= radius


def global_local_pattern(n, radius, n_global):
    i, j = positions(n)
    return window_pattern(n, radius) | (i < n_global) | (j < n_global)


def strided_patterns(n, stride):
    i, j = positions(n)
    causal = causal_pattern(n)
    return causal & (i - j <= stride), causal & ((i - j) % stride == 0)


def fixed_patterns(n, stride, summary):
    i, j = positions(n)
    causal = causal_pattern(n)
    return causal & (i // stride == j // stride), causal & (j % stride >= stride - summary)


def to_blocks(x, block):
    """(..., N, d) -> (..., N_blocks, block, d), zero-padding N up to a multiple of block."""
    return F.pad(x, (0, 0, 0, -x.shape[-2] % block)).unflatten(-2, (-1, block))


def with_neighbours(x, block):
    """(..., N, d) -> (..., N_blocks, 3 * block, d): each block's previous, own and next block."""
    blocks = F.pad(to_blocks(x, block), (0, 0, 0, 0, 1, 1))
    return torch.cat([blocks[..., :-2, :, :], blocks[..., 1:-1, :, :], blocks[..., 2:, :, :]], dim=-2)


def local_scores(q, k, left, right):
    """Scores of each query against keys i-left..i+right, in blocks: (..., N_blocks, block, 3 * block)."""
    n, d = q.shape[-2:]
    block = max(left, right, 1)
    scores = to_blocks(q, block) @ with_neighbours(k, block).transpose(-2, -1) / math.sqrt(d)
    n_blocks = scores.shape[-3]
    query_pos = torch.arange(n_blocks * block).view(n_blocks, block, 1)
    key_pos = torch.arange(-block, 2 * block) + block * torch.arange(n_blocks).view(n_blocks, 1, 1)
    offset = query_pos - key_pos
    allowed = (offset <= left) & (offset >= -right) & (key_pos >= 0) & (key_pos < n)
    return scores.masked_fill(~allowed, float("-inf")), key_pos


def local_attention(q, k, v, left, right):
    n = q.shape[-2]
    scores, _ = local_scores(q, k, left, right)
    block = scores.shape[-2]
    out = torch.softmax(scores, dim=-1) @ with_neighbours(v, block)
    return out.flatten(-3, -2)[..., :n, :]  # padded query rows are dropped here


def split_qkv(module, x):
    """The per-head q, k, v (batch, heads, N, d_head) that the source modules compute from x."""
    batch, n, _ = x.shape
    qkv = module.qkv(x).reshape(batch, n, 3, module.num_heads, -1)
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def merge_and_project(module, out):
    batch, _, n, _ = out.shape
    return module.out_proj(out.transpose(1, 2).reshape(batch, n, -1))


def global_local_attention(q, k, v, radius, n_global):
    """Window of radius `radius` for every query, plus global positions 0..n_global-1 (both ways)."""
    n, d = q.shape[-2:]
    window_scores, key_pos = local_scores(q, k, radius, radius)
    window_scores = window_scores.masked_fill(key_pos < n_global, float("-inf"))
    block = window_scores.shape[-2]
    global_scores = to_blocks(q, block) @ k[..., None, :n_global, :].transpose(-2, -1) / math.sqrt(d)
    weights = torch.softmax(torch.cat([window_scores, global_scores], dim=-1), dim=-1)
    out = (weights[..., :-n_global] @ with_neighbours(v, block)
           + weights[..., -n_global:] @ v[..., None, :n_global, :])
    global_rows = full_attention(q[..., :n_global, :], k, v)
    return torch.cat([global_rows, out.flatten(-3, -2)[..., n_global:n, :]], dim=-2)


def sparse_factor_attention(q, k, v, stride, pattern, causal=True):
    """pattern="row": attend within consecutive blocks of `stride` positions (fixed A1);
    pattern="column": attend positions a multiple of `stride` apart (strided A2)."""
    n = q.shape[-2]
    position = to_blocks(torch.arange(n)[:, None], stride).squeeze(-1)  # (rows, stride)
    position[-1, n % stride or stride:] = n  # padding: positions beyond the sequence
    grid = lambda x: to_blocks(x, stride)
    if pattern == "column":
        grid = lambda x: to_blocks(x, stride).transpose(-3, -2)
        position = position.T
    mask = (position < n)[..., None, :]
    if causal:
        mask = mask & (position[..., None, :] <= position[..., :, None])
    out = full_attention(grid(q), grid(k), grid(v), mask)
    if pattern == "column":
        out = out.transpose(-3, -2)
    return out.flatten(-3, -2)[..., :n, :]
