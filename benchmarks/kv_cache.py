"""KV-cache size and decode-step attention time: MHA, GQA-8 and MQA on the CPU.

One decoder layer with 32 query heads of width 128, batch 8, float32. For each context length
the benchmark times the attention of one new token against a preallocated KV cache: the scores
q K^T, the softmax and the weighted sum of V. The projections, the cache update and the output
projection are not timed; they do not depend on the context length.

GQA is computed the way a decoder does it, without copying the cache: the h query heads are
viewed as (B, G, h/G, d), so each group's h/G queries form the rows of one matrix product with
that group's (S, d) keys and each key/value head is read once. (Writing the queries as
(B, G, h/G, 1, d) against keys (B, G, 1, S, d) would be the same maths, but torch.matmul
materialises the broadcast key tensor, i.e. the h/G copies that repeat_interleave makes.)

Repetitions are interleaved (every variant at every context once per round) after a warm-up
round, and the median is reported. Run:  python -m benchmarks.kv_cache [--quick] [--threads N]
"""

import argparse
import math
import os
import platform
import statistics
import time

import torch

NUM_HEADS = 32
HEAD_DIM = 128
BATCH = 8
DTYPE = torch.float32
KV_HEADS = {"mha": NUM_HEADS, "gqa8": 8, "mqa": 1}
LABELS = {"mha": "MHA", "gqa8": "GQA-8", "mqa": "MQA"}


def cache_bytes(kv_heads, context, batch=BATCH, head_dim=HEAD_DIM, bytes_per_element=4):
    """Bytes of the keys and values of one layer: 2 * batch * kv_heads * context * head_dim * bytes."""
    return 2 * batch * kv_heads * context * head_dim * bytes_per_element


def decode_attention(q, k_cache, v_cache, context):
    """Attention of one new token per sequence to the first `context` cached positions.

    q: (B, H, d); k_cache, v_cache: (B, G, max_context, d) preallocated. Returns (B, H, d).
    Query head i reads key/value head i // (H / G).
    """
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[:, :, :context]
    values = v_cache[:, :, :context]
    grouped_q = q.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = grouped_q @ keys.transpose(-2, -1) / math.sqrt(head_dim)  # (B, G, H/G, S)
    return (scores.softmax(dim=-1) @ values).view(batch, num_heads, head_dim)


def reference_attention(q, k_cache, v_cache, context):
    """The same attention with the key/value heads copied out to all query heads."""
    repeats = q.shape[1] // k_cache.shape[1]
    keys = k_cache[:, :, :context].repeat_interleave(repeats, dim=1)
    values = v_cache[:, :, :context].repeat_interleave(repeats, dim=1)
    weights = torch.softmax(torch.einsum("bhd,bhsd->bhs", q, keys) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("bhs,bhsd->bhd", weights, values)


def machine_description():
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    caches = []
    for index in range(4):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            with open(f"{base}/level") as level, open(f"{base}/type") as kind, open(f"{base}/size") as size:
                caches.append(f"L{level.read().strip()} {kind.read().strip().lower()} {size.read().strip()}")
        except OSError:
            continue
    return {
        "cpu": cpu_model,
        "cores": os.cpu_count(),
        "caches (per instance)": ", ".join(caches) or "unknown",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        # Other processes on the machine: with a load above the core count, multithreaded
        # steps wait for descheduled threads and the timings stop measuring the attention.
        "load average (1 min)": f"{os.getloadavg()[0]:.2f}",
    }


def read_bandwidth(buffer, repeats=3):
    """Bytes per second of a full read of `buffer` (a sum), the best of a few tries."""
    buffer.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


def run(contexts, repeats):
    torch.manual_seed(0)
    max_context = max(contexts)
    caches = {}
    for name, kv_heads in KV_HEADS.items():
        shape = (BATCH, kv_heads, max_context, HEAD_DIM)
        # Written, not just allocated: untouched pages would read as shared zero pages.
        caches[name] = (torch.empty(shape, dtype=DTYPE).normal_(), torch.empty(shape, dtype=DTYPE).normal_())
    q = torch.randn(BATCH, NUM_HEADS, HEAD_DIM, dtype=DTYPE)

    for name, (k_cache, v_cache) in caches.items():
        got = decode_attention(q, k_cache, v_cache, min(contexts))
        expected = reference_attention(q, k_cache, v_cache, min(contexts))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"{name} attention is wrong")

    times = {(name, context): [] for name in KV_HEADS for context in contexts}
    for round_index in range(repeats + 1):  # round 0 is the warm-up
        for context in contexts:
            for name, (k_cache, v_cache) in caches.items():
                start = time.perf_counter()
                decode_attention(q, k_cache, v_cache, context)
                elapsed = time.perf_counter() - start
                if round_index:
                    times[(name, context)].append(elapsed)
    medians = {key: statistics.median(values) for key, values in times.items()}
    bandwidth = read_bandwidth(caches["mha"][0])
    return medians, bandwidth


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small contexts and few repetitions (a smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9, or 3 with --quick)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [128, 256] if args.quick else [512, 1024, 2048, 4096, 8192]
    repeats = args.repeats or (3 if args.quick else 9)

    print("KV cache and decode-step attention: MHA vs GQA-8 vs MQA")
    for key, value in machine_description().items():
        print(f"  {key}: {value}")
    print(f"  layer: {NUM_HEADS} query heads, head_dim {HEAD_DIM}, batch {BATCH}, float32, one decoder layer")
    print("  timed: q K^T, softmax, weights V for one new token (median of "
          f"{repeats} interleaved rounds after a warm-up)")

    medians, bandwidth = run(contexts, repeats)

    header = f"{'context':>8} | " + " | ".join(f"{LABELS[n] + ' ms':>9}" for n in KV_HEADS)
    header += f" | {'GQA-8 x':>7} | {'MQA x':>6} | " + " | ".join(f"{LABELS[n] + ' MiB':>9}" for n in KV_HEADS)
    header += f" | {'MHA GB/s':>8}"
    print()
    print(header)
    print("-" * len(header))
    results = {}
    for context in contexts:
        ms = {name: 1e3 * medians[(name, context)] for name in KV_HEADS}
        size = {name: cache_bytes(kv_heads, context) for name, kv_heads in KV_HEADS.items()}
        speedup = {name: ms["mha"] / ms[name] for name in ("gqa8", "mqa")}
        mha_gbps = size["mha"] / medians[("mha", context)] / 1e9
        print(
            f"{context:>8} | " + " | ".join(f"{ms[n]:9.3f}" for n in KV_HEADS)
            + f" | {speedup['gqa8']:7.2f} | {speedup['mqa']:6.2f} | "
            + " | ".join(f"{size[n] / 2**20:9.1f}" for n in KV_HEADS)
            + f" | {mha_gbps:8.2f}"
        )
        for name in KV_HEADS:
            results[f"{name}_ms_at_{context}"] = f"{ms[name]:.4f}"
            results[f"{name}_cache_bytes_at_{context}"] = str(size[name])
        for name in ("gqa8", "mqa"):
            results[f"{name}_speedup_vs_mha_at_{context}"] = f"{speedup[name]:.3f}"
            results[f"{name}_cache_ratio_vs_mha_at_{context}"] = f"{size['mha'] / size[name]:.3f}"
        for name in KV_HEADS:
            results[f"{name}_effective_gbps_at_{context}"] = f"{size[name] / medians[(name, context)] / 1e9:.3f}"
    print("(GQA-8 x, MQA x: MHA's time divided by theirs; MiB: K and V cache of the layer; "
          "MHA GB/s: MHA cache bytes read per second)")
    print(f"memory read bandwidth (sum over the {cache_bytes(NUM_HEADS, max(contexts)) // 2 / 2**20:.0f} MiB "
          f"MHA key cache): {bandwidth / 1e9:.2f} GB/s")
    print()
    results["read_bandwidth_gbps"] = f"{bandwidth / 1e9:.3f}"
    results["threads"] = str(torch.get_num_threads())
    for name, value in results.items():
        print(f"{name}={value}")


if __name__ == "__main__":
    main()
