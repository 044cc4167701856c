"""Sliding-window attention: a prefill with the band's key blocks skipped, and a decoding step from a rolling cache.

    python -m benchmarks.window            # the full run, a few minutes on one CPU thread
    python -m benchmarks.window --quick    # a smoke run, seconds

On the CPU, one thread, float32, 2 heads of width 64:

- prefill of N = 4k ... 32k tokens with a window of W = 1k: the tiled forward pass with the key blocks
  outside the band skipped, against the same loop with W = N (full causal), best of a few interleaved
  calls. The ideal ratio is the ratio of their work, the (query, key) pairs each computes:
  (N (N + 1) / 2) / (N W - W (W - 1) / 2), close to N / (2W); the tiles on the band's two edges are
  computed whole, so the ratio reached is below it.
- a decoding step (write one token's key and value, attend with one query) for 8 heads of width 128,
  from a full cache of N tokens, a rolling cache of W slots and one of W + 4 slots (4 attention sinks),
  and the bytes of each cache's keys and values.

On a CUDA GPU (where `torch.cuda.is_available()`), also: a Triton kernel that skips the band's key
blocks against `F.scaled_dot_product_attention` given the band as a boolean mask, in bfloat16, batch 1,
16 heads of width 128, TFLOP/s by FlashAttention-2's convention (4 d FLOPs per (query, key) pair)
counting only the band's pairs. Without a GPU that part is skipped with a line saying so. The last
lines are `name=value` pairs for scripts.
"""

import argparse
import math
import platform
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WINDOW = 1024
LENGTHS = (4096, 8192, 16384, 32768)
QUICK_LENGTHS = (1024, 2048)
QUICK_WINDOW = 256
HEADS, HEAD_DIM = 2, 64
BLOCK = 128  # square tiles: the band's edges waste at most one tile per query block and edge
DECODE_HEADS, DECODE_DIM, SINKS = 8, 128, 4
GOAL = 0.8  # measured ratio / ideal ratio at the longest N
GPU_HEADS, GPU_DIM = 16, 128


def band_forward(q, k, v, window, block=BLOCK):
    """Attention under the bottom-right sliding window, q (heads, L, d), k and v (heads, S, d) -> out.

    Tiled as FlashAttention-2's forward pass: for each query block, only the key blocks that hold a
    key of its band are visited; the band's edges are masked with a bias built once per tile shape
    and offset. Score tiles are written in place into one reused buffer per tile shape.
    """
    heads, L, d = q.shape
    S = k.shape[1]
    diagonal, scale = S - L, 1 / math.sqrt(d)
    out = torch.empty_like(q)
    tiles, biases = {}, {}
    for q_start in range(0, L, block):
        q_end = min(q_start + block, L)
        rows = q_end - q_start
        row_max = torch.full((heads, rows, 1), -math.inf, dtype=q.dtype)
        row_sum = torch.zeros((heads, rows, 1), dtype=q.dtype)
        acc = torch.zeros((heads, rows, v.shape[-1]), dtype=q.dtype)
        first = max(0, q_start + diagonal - window + 1)  # the first key of the block's band
        stop = min(S, q_end + diagonal)
        for k_start in range(first // block * block, stop, block):
            k_end = min(k_start + block, stop)
            shape = (rows, k_end - k_start)
            if shape not in tiles:
                tiles[shape] = torch.empty((heads, *shape), dtype=q.dtype)
            scores = tiles[shape]
            scores.baddbmm_(q[:, q_start:q_end], k[:, k_start:k_end].transpose(1, 2), beta=0, alpha=scale)
            offset = q_start + diagonal - k_start  # the last key of the tile's first row, from k_start
            if k_end - 1 > offset + k_start or k_start <= q_end - 1 + diagonal - window:  # an edge crosses it
                if (shape, offset) not in biases:
                    last = torch.arange(shape[0])[:, None] + offset
                    keys = torch.arange(shape[1])
                    outside = (keys > last) | (keys <= last - window)
                    biases[shape, offset] = torch.zeros(shape, dtype=q.dtype).masked_fill_(outside, -math.inf)
                scores.add_(biases[shape, offset])
            new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
            shift = new_max.masked_fill(new_max == -math.inf, 0)  # rows that have seen no key yet
            probs = scores.sub_(shift).exp_()
            rescale = (row_max - shift).exp_()
            row_sum.mul_(rescale).add_(probs.sum(-1, keepdim=True))
            acc.mul_(rescale).baddbmm_(probs, v[:, k_start:k_end])
            row_max = new_max
        out[:, q_start:q_end] = acc.div_(row_sum.masked_fill(row_sum == 0, 1))
    return out


def band_pairs(length, window):
    """(query, key) pairs under the window with L = S = length."""
    window = min(window, length)
    return length * window - window * (window - 1) // 2


def best_times(fns, repeats):
    """Best wall time of each function, calls interleaved so they share the same load."""
    times = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - start)
    return times


def check_band(window):
    """The tiled band against attention under the same mask, computed whole, in float64."""
    q, k, v = (torch.randn(HEADS, 700, HEAD_DIM, dtype=torch.float64) for _ in range(3))
    for L, w in ((700, window), (300, window), (700, 700), (700, 1)):
        allowed = torch.ones(L, 700, dtype=torch.bool).tril(700 - L).triu(700 - L - w + 1)
        want = F.scaled_dot_product_attention(q[:, -L:], k, v, attn_mask=allowed)
        error = (band_forward(q[:, -L:], k, v, w) - want).abs().max().item()
        assert error < 1e-10, f"band_forward differs from masked attention by {error:.1e} (L = {L}, W = {w})"


def prefill(lengths, window):
    rows = []
    for n in lengths:
        q, k, v = (torch.randn(HEADS, n, HEAD_DIM) for _ in range(3))
        band, causal = best_times([lambda: band_forward(q, k, v, window), lambda: band_forward(q, k, v, n)],
                                  repeats=3 if n <= 8192 else 2)
        ideal = band_pairs(n, n) / band_pairs(n, window)
        rows.append({"N": n, "band_s": band, "causal_s": causal, "ratio": causal / band, "ideal": ideal})
    return rows


class RingCache:
    """Keys and values in `slots` preallocated slots, written round-robin (the first `sinks` kept)."""

    def __init__(self, slots, sinks=0):
        self.k = torch.zeros(DECODE_HEADS, slots, DECODE_DIM)
        self.v = torch.zeros_like(self.k)
        self.slots, self.sinks, self.length = slots, sinks, 0

    def step(self, q, k, v):
        """Write one token, attend with one query over the written slots (their order does not matter:
        keys were rotated by their positions before the write)."""
        ring = self.slots - self.sinks
        slot = self.length if self.length < self.sinks else self.sinks + (self.length - self.sinks) % ring
        self.k[:, slot], self.v[:, slot] = k, v
        self.length += 1
        filled = min(self.length, self.slots)
        scores = self.k[:, :filled] @ q[:, :, None] / math.sqrt(DECODE_DIM)
        return (torch.softmax(scores, dim=1).transpose(1, 2) @ self.v[:, :filled]).squeeze(1)

    def nbytes(self):
        return self.k.nbytes + self.v.nbytes


def decode(lengths, window):
    rows = []
    token = [torch.randn(DECODE_HEADS, DECODE_DIM) for _ in range(3)]
    for n in lengths:
        caches = {"full": RingCache(n), "window": RingCache(window), "window + sinks": RingCache(window + SINKS, SINKS)}
        for cache in caches.values():
            cache.length = n - 1  # the context so far: every slot written (values are zeros, which costs the same)
        steps = best_times([lambda c=c: c.step(*token) for c in caches.values()], repeats=200)
        rows.append({"N": n, **{f"{name}_us": 1e6 * s for name, s in zip(caches, steps)},
                     **{f"{name}_bytes": c.nbytes() for name, c in caches.items()}})
    return rows


if torch.cuda.is_available():  # Triton compiles for the GPU; without one this part is skipped
    import triton
    import triton.language as tl
    import triton.testing

    @triton.jit
    def band_kernel(Q, K, V, Out, L, S, window, scale,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Query block program_id(0) of head program_id(1), over the key blocks of its band only.

        Q, Out: (heads, L, HEAD_DIM); K, V: (heads, S, HEAD_DIM), contiguous; bottom-right aligned."""
        q_block = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        dims = tl.arange(0, HEAD_DIM)
        Q += head * L * HEAD_DIM
        K += head * S * HEAD_DIM
        V += head * S * HEAD_DIM
        q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < L, other=0.0)
        row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        diagonal = S - L
        first = tl.maximum(0, q_block * BLOCK_Q + diagonal - window + 1)
        stop = tl.minimum(S, (q_block + 1) * BLOCK_Q + diagonal)
        for k_start in range(first // BLOCK_K * BLOCK_K, stop, BLOCK_K):  # only the band's key blocks
            cols = k_start + tl.arange(0, BLOCK_K)
            k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < S, other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            last = rows[:, None] + diagonal
            allowed = (cols[None, :] < S) & (cols[None, :] <= last) & (cols[None, :] > last - window)
            scores = tl.where(allowed, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - shift[:, None])
            rescale = tl.exp(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(probs, 1)
            v = tl.load(V + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < S, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
            row_max = new_max
        safe_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
        tl.store(Out + head * L * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :],
                 (acc / safe_sum[:, None]).to(Out.dtype.element_ty), mask=rows[:, None] < L)

    def band_triton(q, k, v, w, block_q=128, block_k=64):
        heads, L, d = q.shape
        out = torch.empty_like(q)
        band_kernel[(triton.cdiv(L, block_q), heads)](q, k, v, out, L, k.shape[1], w, 1 / math.sqrt(d),
                                                       BLOCK_Q=block_q, BLOCK_K=block_k, HEAD_DIM=d,
                                                       num_warps=8, num_stages=3)
        return out


def gpu_part(lengths, window):
    """The Triton band kernel against SDPA with the band as a mask, on the GPU; None without one."""
    if not torch.cuda.is_available():
        return None
    rows = []
    for n in lengths:
        # (1, heads, N, d): SDPA's fused kernels take 4-D inputs (3-D ones fall back to its math path).
        q, k, v = (torch.randn(1, GPU_HEADS, n, GPU_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        allowed = torch.ones(n, n, dtype=torch.bool, device="cuda").tril().triu(1 - window)

        def masked():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # the fused kernel that takes a mask
                return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

        error = (band_triton(q[0], k[0], v[0], window).float() - masked()[0].float()).abs().max().item()
        assert error < 2e-2, f"the Triton band kernel differs from SDPA with the mask by {error:.3g} at N = {n}"
        flops = 4 * GPU_DIM * GPU_HEADS * band_pairs(n, window)
        triton_ms = triton.testing.do_bench(lambda: band_triton(q[0], k[0], v[0], window))
        sdpa_ms = triton.testing.do_bench(masked)
        rows.append({"N": n, "triton_ms": triton_ms, "sdpa_mask_ms": sdpa_ms,
                     "triton_tflops": flops / triton_ms / 1e9, "sdpa_mask_tflops": flops / sdpa_ms / 1e9,
                     "max_error": error})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of seconds")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a shared machine's cores blur ratios; one thread is what is compared
    lengths, window = (QUICK_LENGTHS, QUICK_WINDOW) if args.quick else (LENGTHS, WINDOW)
    check_band(window // 4)
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, float32")

    print(f"\nPrefill, {HEADS} heads of width {HEAD_DIM}, W = {window}, tiles of {BLOCK}:")
    print("| N | band-skipping (s) | full causal (s) | causal / band | ideal | reached |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    filled = prefill(lengths, window)
    for r in filled:
        print(f"| {r['N']:,} | {r['band_s']:.3f} | {r['causal_s']:.3f} | {r['ratio']:.1f} | {r['ideal']:.1f} "
              f"| {r['ratio'] / r['ideal']:.2f} |")

    print(f"\nDecoding one token, {DECODE_HEADS} heads of width {DECODE_DIM}, W = {window}, {SINKS} sinks:")
    print("| context N | full (µs) | window (µs) | window + sinks (µs) | full cache | window | window + sinks |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    steps = decode(lengths, window)
    for r in steps:
        sizes = " | ".join(f"{r[f'{name}_bytes'] / 2**20:.2f} MiB" for name in ("full", "window", "window + sinks"))
        print(f"| {r['N']:,} | {r['full_us']:.0f} | {r['window_us']:.0f} | {r['window + sinks_us']:.0f} | {sizes} |")

    gpu = gpu_part(lengths, window)
    if gpu is None:
        print("\nGPU: skipped, no CUDA GPU (torch.cuda.is_available() is False)")
    else:
        print(f"\nGPU: {torch.cuda.get_device_name(0)}, bfloat16, {GPU_HEADS} heads of width {GPU_DIM}, W = {window}; "
              "TFLOP/s over the band's pairs only:")
        print("| N | Triton band (ms) | SDPA + mask (ms) | Triton TFLOP/s | SDPA + mask TFLOP/s |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for r in gpu:
            print(f"| {r['N']:,} | {r['triton_ms']:.3f} | {r['sdpa_mask_ms']:.3f} | {r['triton_tflops']:.1f} "
                  f"| {r['sdpa_mask_tflops']:.1f} |")

    longest = filled[-1]
    reached = longest["ratio"] / longest["ideal"]
    print(f"\nprefill_ratio={longest['ratio']:.2f}")
    print(f"prefill_ideal={longest['ideal']:.2f}")
    print(f"prefill_reached={reached:.3f}")
    print(f"prefill_goal_met={reached >= GOAL}")
    print(f"decode_window_bytes={steps[-1]['window_bytes']}")


if __name__ == "__main__":
    main()
