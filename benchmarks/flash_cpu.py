"""A tiled FlashAttention-style forward pass against PyTorch's SDPA, on the CPU.

    python -m benchmarks.flash_cpu            # the full run, a few minutes
    python -m benchmarks.flash_cpu --quick    # a smoke run, seconds

For fp32, B*H = 8 heads of width d = 64, N queries and N keys, causal and not, it reports
side by side:

- time: the tiled forward's wall time over `F.scaled_dot_product_attention`'s (the best
  of a few interleaved calls, so both see the same load on a shared machine);
- peak extra memory: the most bytes allocated during one call and still live at once,
  above what existed before it, as `torch.profiler` records every allocation of the CPU
  allocator (`profile_memory=True`). The profiler sees the kernels' internal workspaces,
  which a `TorchDispatchMode` cannot (it sees only the tensors each operator returns, and
  SDPA is a single operator);
- causal over non-causal time, for each implementation.

It runs on one thread by default: on a machine whose cores are shared, an OpenMP team
waits at every barrier for its slowest, descheduled thread, which blurs the ratios far
more than it changes them. The last lines are `name=value` pairs for scripts.
"""

import argparse
import json
import math
import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

HEADS = 8
HEAD_DIM = 64
FULL_LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (256, 512)
# 256 x 512 fp32 score tiles for 8 heads are 4 MiB: large enough that the matmuls run
# near BLAS speed and Python's per-block overhead is small, small enough to stay in cache.
BLOCK_Q = 256
BLOCK_K = 512

GOAL_TIME_RATIO = 2.0  # tiled time / SDPA time, at N >= 4096
GOAL_MIN_LENGTH = 4096
GOAL_MEMORY_RATIO = 2.0  # tiled peak extra / bytes of q, k, v and out, at the largest N
GOAL_CAUSAL_RATIO = 0.6  # tiled causal time / tiled non-causal time


def tiled_attention_forward(q, k, v, causal=False, block_q=BLOCK_Q, block_k=BLOCK_K):
    """FlashAttention-2 forward, vectorised over batch and heads.

    `q (B, H, L, d)`, `k`/`v (B, H, S, d)` -> `out (B, H, L, d)`, `lse (B, H, L)`.
    Causal masks are bottom-right aligned; a query row that may attend no key gets output
    0 and logsumexp -inf. Score tiles are written in place into one reused buffer per
    tile shape, because a fresh multi-megabyte tensor per tile costs page faults.
    """
    B, H, L, d = q.shape
    S = k.shape[2]
    heads = B * H
    q3, k3, v3 = q.reshape(heads, L, d), k.reshape(heads, S, d), v.reshape(heads, S, d)
    scale = 1 / math.sqrt(d)
    diagonal = S - L  # query i may attend key j iff j <= i + diagonal
    out = torch.empty(heads, L, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, L, dtype=q.dtype, device=q.device)
    tiles = {}
    causal_biases = {}
    for q_start in range(0, L, block_q):
        q_end = min(q_start + block_q, L)
        rows = q_end - q_start
        q_block = q3[:, q_start:q_end]
        row_max = torch.full((heads, rows, 1), -math.inf, dtype=q.dtype, device=q.device)
        row_sum = torch.zeros((heads, rows, 1), dtype=q.dtype, device=q.device)
        acc = torch.zeros((heads, rows, v.shape[-1]), dtype=q.dtype, device=q.device)
        # Keys past the block's last visible one are masked for every row: skip them.
        k_stop = min(S, q_end + diagonal) if causal else S
        for k_start in range(0, k_stop, block_k):
            k_end = min(k_start + block_k, k_stop)
            shape = (rows, k_end - k_start)
            if shape not in tiles:
                tiles[shape] = torch.empty((heads, *shape), dtype=q.dtype, device=q.device)
            scores = tiles[shape]
            scores.baddbmm_(q_block, k3[:, k_start:k_end].transpose(1, 2), beta=0, alpha=scale)
            if causal and k_end - 1 > q_start + diagonal:
                # The mask of a diagonal tile depends only on its shape and on where the
                # diagonal enters it, which repeat from block to block: build each once.
                entry = q_start + diagonal - k_start
                if (shape, entry) not in causal_biases:
                    above = (torch.arange(shape[1], device=q.device)
                             > torch.arange(shape[0], device=q.device).unsqueeze(1) + entry)
                    causal_biases[shape, entry] = torch.zeros(
                        shape, dtype=q.dtype, device=q.device).masked_fill_(above, -math.inf)
                scores.add_(causal_biases[shape, entry])
            new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
            # A row that has seen only masked keys keeps max -inf; shift it by 0 instead.
            shift = new_max.masked_fill(new_max == -math.inf, 0)
            probs = scores.sub_(shift).exp_()
            rescale = (row_max - shift).exp_()
            row_sum.mul_(rescale).add_(probs.sum(-1, keepdim=True))
            acc.mul_(rescale).baddbmm_(probs, v3[:, k_start:k_end])
            row_max = new_max
        # Rows that attend nothing have acc = 0 and row_sum = 0: divide by 1, not 0.
        out[:, q_start:q_end] = acc.div_(row_sum.masked_fill(row_sum == 0, 1))
        lse[:, q_start:q_end] = (row_max + row_sum.log()).squeeze(-1)
    return out.reshape(B, H, L, -1), lse.reshape(B, H, L)


def sdpa(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def tiled(q, k, v, causal=False):
    return tiled_attention_forward(q, k, v, causal)[0]


def peak_extra_bytes(fn):
    """Peak of the bytes allocated during `fn()` and live at the same time."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    # "Total Allocated" counts only what was allocated since the profiler started.
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def best_times(fns, repeats):
    """Best wall time of each function, calls interleaved so they share the same load."""
    times = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - start)
    return times


def machine_description():
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
        f"SIMD {torch.backends.cpu.get_cpu_capability()}, Python {platform.python_version()}"
    )


def measure(length, causal):
    torch.manual_seed(length)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM) for _ in range(3))
    reference = sdpa(q, k, v, causal)
    error = (tiled(q, k, v, causal) - reference).abs().max().item()
    del reference
    fns = [lambda: sdpa(q, k, v, causal), lambda: tiled(q, k, v, causal)]
    # The profiled call doubles as the warm-up of each implementation.
    peaks = [peak_extra_bytes(fn) for fn in fns]
    repeats = 3 if length <= GOAL_MIN_LENGTH else 2
    times = best_times(fns, repeats)
    tensor_bytes = 4 * q.nbytes  # q, k, v and the output
    return dict(
        length=length, causal=causal, error=error, sdpa_s=times[0], tiled_s=times[1],
        sdpa_peak=peaks[0], tiled_peak=peaks[1], tensor_bytes=tensor_bytes,
    )


def mib(nbytes):
    return nbytes / 2**20


TABLE_HEADER = (f"{'N':>6} {'causal':>6} {'max|err|':>9} {'SDPA s':>8} {'tiled s':>8} "
                f"{'time x':>7} {'SDPA MiB':>9} {'tiled MiB':>10} {'mem x':>7} {'tiled/qkvo':>10}")


def table_row(r):
    return (f"{r['length']:>6} {str(r['causal']):>6} {r['error']:>9.1e} {r['sdpa_s']:>8.3f} "
            f"{r['tiled_s']:>8.3f} {r['tiled_s'] / r['sdpa_s']:>7.2f} {mib(r['sdpa_peak']):>9.1f} "
            f"{mib(r['tiled_peak']):>10.1f} {r['tiled_peak'] / max(r['sdpa_peak'], 1):>7.2f} "
            f"{r['tiled_peak'] / r['tensor_bytes']:>10.2f}")


def report(rows):
    """The summaries that need every row: causal ratios, goals, then name=value lines."""
    by_key = {(r["length"], r["causal"]): r for r in rows}
    lengths = sorted({r["length"] for r in rows})
    print("\ncausal / non-causal time")
    print(f"{'N':>6} {'SDPA':>6} {'tiled':>6}")
    for n in lengths:
        full, causal = by_key[(n, False)], by_key[(n, True)]
        print(f"{n:>6} {causal['sdpa_s'] / full['sdpa_s']:>6.2f} {causal['tiled_s'] / full['tiled_s']:>6.2f}")

    largest = lengths[-1]
    long_rows = [r for r in rows if r["length"] >= GOAL_MIN_LENGTH]
    worst_time = max((r["tiled_s"] / r["sdpa_s"] for r in long_rows), default=None)
    worst_memory = max(by_key[(largest, c)]["tiled_peak"] / by_key[(largest, c)]["tensor_bytes"]
                       for c in (False, True))
    causal_ratio = by_key[(largest, True)]["tiled_s"] / by_key[(largest, False)]["tiled_s"]
    print(f"\ngoals (set for N up to {FULL_LENGTHS[-1]}; a --quick run only shows that it works)")
    if worst_time is None:
        print(f"  time <= {GOAL_TIME_RATIO}x SDPA at N >= {GOAL_MIN_LENGTH}: not measured (no such N)")
    else:
        print(f"  time <= {GOAL_TIME_RATIO}x SDPA at N >= {GOAL_MIN_LENGTH}: worst {worst_time:.2f}x, "
              f"{'met' if worst_time <= GOAL_TIME_RATIO else 'NOT met'}")
    print(f"  peak extra memory < {GOAL_MEMORY_RATIO}x bytes of q, k, v, out at N = {largest}: "
          f"worst {worst_memory:.2f}x, {'met' if worst_memory < GOAL_MEMORY_RATIO else 'NOT met'}")
    print(f"  causal <= {GOAL_CAUSAL_RATIO}x non-causal time at N = {largest}: {causal_ratio:.2f}x, "
          f"{'met' if causal_ratio <= GOAL_CAUSAL_RATIO else 'NOT met'}")

    print()
    for r in rows:
        tag = f"n{r['length']}_{'causal' if r['causal'] else 'full'}"
        print(f"time_ratio_{tag}={r['tiled_s'] / r['sdpa_s']:.4f}")
        print(f"memory_ratio_{tag}={r['tiled_peak'] / max(r['sdpa_peak'], 1):.4f}")
        print(f"tiled_peak_over_qkvo_{tag}={r['tiled_peak'] / r['tensor_bytes']:.4f}")
    for n in lengths:
        print(f"causal_time_ratio_n{n}={by_key[(n, True)]['tiled_s'] / by_key[(n, False)]['tiled_s']:.4f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N only: a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    print(f"machine: {machine_description()}")
    print(f"fp32, B*H = {HEADS}, d = {HEAD_DIM}, tiled blocks {BLOCK_Q} x {BLOCK_K}\n", flush=True)
    print(TABLE_HEADER, flush=True)
    rows = []
    for n in lengths:
        for causal in (False, True):
            rows.append(measure(n, causal))
            print(table_row(rows[-1]), flush=True)
    report(rows)


if __name__ == "__main__":
    main()
