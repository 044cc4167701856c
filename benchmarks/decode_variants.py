"""Decoding one token: cache bytes and attention time against the context, for MHA, GQA-8, MQA and
multi-head latent attention (MLA), explicit and with weight absorption; and a paged cache and
split-KV decoding against a contiguous cache.

One layer, 32 query heads of width 128 (model width 4096), float32 on the CPU, one new token per
sequence. MLA as DeepSeek-V2 sizes it: a latent of 512 per token and a shared rotary key of 64.
- MHA, GQA-8, MQA: q K^T, softmax, weights V against a preallocated cache of key/value heads.
- MLA explicit: the cached latents expanded into per-head keys and values every step
  (c W_UK, c W_UV), then attention as MHA.
- MLA absorbed: W_UK folded into the query (q W_UK^T, one 512-wide query per head), scores against
  the latents themselves plus the rotary part, weights times latents, then W_UV: the cache is never
  expanded.
- Paged: the keys and values read through a block table of 16-token pages, in scrambled order.
- Split-KV: the keys cut into chunks, each chunk's (output, logsumexp), then the merge.
Times are medians of interleaved repetitions after a warm-up; ratios are taken within one run.
Run:  python -m benchmarks.decode_variants [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch

HEADS, HEAD_DIM, LATENT, ROPE = 32, 128, 512, 64
DTYPE = torch.float32
PAGE = 16


def attention(q, keys, values):
    """q (B, G, r, d) against keys/values (B, G, S, d): r query heads per key/value head."""
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.softmax(dim=-1) @ values


def grouped(q, k_cache, v_cache):
    batch, kv_heads = k_cache.shape[:2]
    return attention(q.view(batch, kv_heads, HEADS // kv_heads, HEAD_DIM), k_cache, v_cache)


def mla_weights(generator):
    scale = LATENT ** -0.5
    k_up = torch.randn(LATENT, HEADS, HEAD_DIM, generator=generator, dtype=DTYPE) * scale
    v_up = torch.randn(LATENT, HEADS, HEAD_DIM, generator=generator, dtype=DTYPE) * scale
    return k_up, v_up


def mla_explicit(q_content, q_rope, latents, rope_keys, k_up, v_up):
    """Every step expands the cached latents into per-head keys and values."""
    keys = torch.einsum("bsc,chd->bhsd", latents, k_up)
    values = torch.einsum("bsc,chd->bhsd", latents, v_up)
    scores = (q_content.unsqueeze(2) @ keys.transpose(-2, -1)).squeeze(2) \
        + torch.einsum("bhr,bsr->bhs", q_rope, rope_keys)
    weights = (scores / math.sqrt(HEAD_DIM + ROPE)).softmax(dim=-1)
    return (weights.unsqueeze(2) @ values).squeeze(2)


def mla_absorbed(q_content, q_rope, latents, rope_keys, k_up, v_up):
    """W_UK folded into the query, W_UV applied after the weighted sum: the latents are read as they are."""
    q_latent = torch.einsum("bhd,chd->bhc", q_content, k_up)  # (B, H, 512)
    scores = q_latent @ latents.transpose(1, 2) + q_rope @ rope_keys.transpose(1, 2)  # heads as rows
    weights = (scores / math.sqrt(HEAD_DIM + ROPE)).softmax(dim=-1)
    return torch.einsum("bhc,chd->bhd", weights @ latents, v_up)


def paged(q, k_pages, v_pages, table, context):
    """Keys and values read through the block table: the pages of each sequence, gathered in order."""
    batch, kv_heads = q.shape[0], k_pages.shape[1]
    pages = table[:, : math.ceil(context / PAGE)]
    keys = k_pages[pages].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, HEAD_DIM)[:, :, :context]
    values = v_pages[pages].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, HEAD_DIM)[:, :, :context]
    return attention(q.view(batch, kv_heads, HEADS // kv_heads, HEAD_DIM), keys, values)


def split_kv(q, k_cache, v_cache, splits):
    """Each chunk's output and logsumexp, then their merge."""
    batch, kv_heads, context = k_cache.shape[:3]
    rows = q.view(batch, kv_heads, HEADS // kv_heads, HEAD_DIM) / math.sqrt(HEAD_DIM)
    chunk = math.ceil(context / splits)
    outs, lses = [], []
    for start in range(0, context, chunk):
        scores = rows @ k_cache[:, :, start:start + chunk].transpose(-2, -1)
        lse = scores.logsumexp(dim=-1, keepdim=True)
        outs.append((scores - lse).exp() @ v_cache[:, :, start:start + chunk])
        lses.append(lse)
    lse = torch.stack(lses).logsumexp(dim=0)
    return sum(out * (part - lse).exp() for out, part in zip(outs, lses))


def median_ms(function, rounds):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(contexts, batch, rounds):
    generator = torch.Generator().manual_seed(0)
    k_up, v_up = mla_weights(generator)
    rows, checks = [], {}
    for context in contexts:
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator, dtype=DTYPE)
        caches = {name: [torch.randn(batch, g, context, HEAD_DIM, generator=generator, dtype=DTYPE) for _ in "kv"]
                  for name, g in (("MHA", HEADS), ("GQA-8", 8), ("MQA", 1))}
        latents = torch.randn(batch, context, LATENT, generator=generator, dtype=DTYPE)
        rope_keys = torch.randn(batch, context, ROPE, generator=generator, dtype=DTYPE)
        q_rope = torch.randn(batch, HEADS, ROPE, generator=generator, dtype=DTYPE)
        pages_per_sequence = math.ceil(context / PAGE)
        k_gqa, v_gqa = caches["GQA-8"]
        order = torch.randperm(batch * pages_per_sequence, generator=generator)
        table = order.view(batch, pages_per_sequence)
        k_pages = torch.empty(batch * pages_per_sequence, 8, PAGE, HEAD_DIM, dtype=DTYPE)
        v_pages = torch.empty_like(k_pages)
        padded = pages_per_sequence * PAGE
        for b in range(batch):
            for cache, pages in ((k_gqa, k_pages), (v_gqa, v_pages)):
                filled = torch.zeros(8, padded, HEAD_DIM, dtype=DTYPE)
                filled[:, :context] = cache[b]
                pages[table[b]] = filled.view(8, pages_per_sequence, PAGE, HEAD_DIM).transpose(0, 1)
        variants = {
            **{name: (lambda k=k, v=v: grouped(q, k, v)) for name, (k, v) in caches.items()},
            "MLA explicit": lambda: mla_explicit(q, q_rope, latents, rope_keys, k_up, v_up),
            "MLA absorbed": lambda: mla_absorbed(q, q_rope, latents, rope_keys, k_up, v_up),
            "GQA-8 paged": lambda: paged(q, k_pages, v_pages, table, context),
            "GQA-8 4 splits": lambda: split_kv(q, k_gqa, v_gqa, 4),
        }
        contiguous = grouped(q, k_gqa, v_gqa)
        checks[context] = {
            "mla": (mla_explicit(q, q_rope, latents, rope_keys, k_up, v_up)
                    - mla_absorbed(q, q_rope, latents, rope_keys, k_up, v_up)).abs().max().item(),
            "paged": (paged(q, k_pages, v_pages, table, context) - contiguous).abs().max().item(),
            "split": (split_kv(q, k_gqa, v_gqa, 4) - contiguous).abs().max().item(),
        }
        for function in variants.values():  # warm-up
            function()
        times = {name: [] for name in variants}
        for _ in range(rounds):  # interleaved: every variant once per round
            for name, function in variants.items():
                times[name].append(median_ms(function, 1))
        rows.append((context, {name: statistics.median(values) for name, values in times.items()}))
    return rows, checks


def cache_bytes_per_token():
    """Bytes per token and layer at 2 bytes per number: keys and values of G heads, or latent + rotary key."""
    return {"MHA": 2 * HEADS * HEAD_DIM * 2, "GQA-8": 2 * 8 * HEAD_DIM * 2, "MQA": 2 * 1 * HEAD_DIM * 2,
            "MLA": (LATENT + ROPE) * 2}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short contexts, few rounds")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts, batch, rounds = ([256, 512], 2, 3) if args.quick else ([512, 1024, 2048, 4096], 4, 9)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} thread(s), batch {batch}, {HEADS} query heads of {HEAD_DIM}, float32")
    per_token = cache_bytes_per_token()
    print("cache bytes per token and layer (2 bytes per number): "
          + ", ".join(f"{name} {value}" for name, value in per_token.items()))
    rows, checks = run(contexts, batch, rounds)
    names = list(rows[0][1])
    print(f"\n{'context':>7} " + " ".join(f"{name + ' ms':>16}" for name in names))
    for context, times in rows:
        print(f"{context:>7} " + " ".join(f"{times[name]:>16.2f}" for name in names))
    print("\nratios to MHA (time of MHA / time of the variant; above 1 is faster):")
    for context, times in rows:
        ratios = (f"{name}={times['MHA'] / times[name]:.2f}" for name in names if name != "MHA")
        print(f"{context:>7} " + " ".join(ratios))
    last, times = rows[-1]
    print()
    for name, value in per_token.items():
        print(f"cache_bytes_per_token_{name.replace('-', '').lower()}={value}")
    print(f"mla_absorbed_speedup_over_explicit_at_{last}={times['MLA explicit'] / times['MLA absorbed']:.2f}")
    print(f"paged_over_contiguous_at_{last}={times['GQA-8 paged'] / times['GQA-8']:.2f}")
    print(f"split4_over_one_at_{last}={times['GQA-8 4 splits'] / times['GQA-8']:.2f}")
    print(f"max_abs_difference_mla_absorbed_vs_explicit={max(c['mla'] for c in checks.values()):.2e}")
    print(f"max_abs_difference_paged_vs_contiguous={max(c['paged'] for c in checks.values()):.2e}")
    print(f"max_abs_difference_split_vs_whole={max(c['split'] for c in checks.values()):.2e}")


if __name__ == "__main__":
    main()
