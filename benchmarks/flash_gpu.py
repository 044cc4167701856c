"""A Triton FlashAttention forward kernel against PyTorch's FlashAttention backend, on a GPU.

    python -m benchmarks.flash_gpu                      # needs a CUDA GPU
    python -m benchmarks.flash_gpu --interpret-check    # no GPU: check the kernel on the CPU

fp16, sequence lengths N = 1k ... 16k, head widths d = 64 and 128, causal and not. As in
the FlashAttention-2 paper, the batch holds 16k tokens (batch = 16384 // N) and the model
width is 2048 (heads = 2048 // d); a forward pass counts 4 * N^2 * d FLOPs per head, half
that with the causal mask. Times are medians from `triton.testing.do_bench`. The baseline
is `F.scaled_dot_product_attention` with its backend pinned to
`SDPBackend.FLASH_ATTENTION`. The last lines are `name=value` pairs for scripts.

Without a CUDA GPU the benchmark prints why to stderr and exits with status 0, having run
nothing; `--interpret-check` instead runs the kernel in Triton's interpreter on small
float32 inputs and compares it with naive attention.
"""

import argparse
import math
import os
import platform
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if not torch.cuda.is_available():
    # Read when @triton.jit runs, so it must precede the import: kernels are then interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LENGTHS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
MODEL_WIDTH = 2048
NO_GPU_MESSAGE = (
    "flash_gpu: no CUDA GPU found (torch.cuda.is_available() is False); this benchmark "
    "needs one. On a CPU-only machine run `python -m benchmarks.flash_gpu --interpret-check` "
    "to check the kernel in Triton's interpreter, or `python -m benchmarks.flash_cpu`."
)


@triton.jit
def flash_forward_kernel(Q, K, V, Out, Lse, L, S, scale,
                         CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    """One program: query block program_id(0) of head program_id(1).

    Q, Out: (heads, L, HEAD_DIM); K, V: (heads, S, HEAD_DIM), contiguous; Lse: (heads, L)
    float32. Causal masks are bottom-right aligned; a row that may attend no key gets
    output 0 and logsumexp -inf.
    """
    q_block = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # head * L * HEAD_DIM can pass 2**31
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, HEAD_DIM)
    Q += head * L * HEAD_DIM
    K += head * S * HEAD_DIM
    V += head * S * HEAD_DIM
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < L, other=0.0)

    row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)

    diagonal = S - L  # query i may attend key j iff j <= i + diagonal
    k_stop = S
    if CAUSAL:  # tiles after the block's last visible key are skipped
        k_stop = tl.minimum(S, (q_block + 1) * BLOCK_Q + diagonal)
    for k_start in range(0, k_stop, BLOCK_K):
        cols = k_start + tl.arange(0, BLOCK_K)
        k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < S, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        allowed = cols[None, :] < S
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None] + diagonal)
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
    tl.store(Lse + head * L + rows, row_max + tl.log(safe_sum), mask=rows < L)


# Tile shapes and pipelining to try on the GPU; the autotuner times each once per key.
flash_forward_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_Q": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_Q": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_Q": 128, "BLOCK_K": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_Q": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    ],
    key=["L", "S", "HEAD_DIM", "CAUSAL"],
)(flash_forward_kernel)


def flash_attention_triton(q, k, v, causal=False, blocks=None):
    """q (B, H, L, d), k and v (B, H, S, d) -> out (B, H, L, d), lse (B, H, L).

    `blocks=(block_q, block_k)` launches the plain kernel with those tiles (the only way
    under the interpreter); `None` lets the autotuner choose on the GPU.
    """
    B, H, L, d = q.shape
    S = k.shape[-2]
    q3, k3, v3 = (t.reshape(B * H, -1, d).contiguous() for t in (q, k, v))
    out = torch.empty_like(q3)
    lse = torch.empty(B * H, L, dtype=torch.float32, device=q.device)
    scale = 1 / math.sqrt(d)
    if blocks is None:
        grid = lambda meta: (triton.cdiv(L, meta["BLOCK_Q"]), B * H)  # noqa: E731
        flash_forward_tuned[grid](q3, k3, v3, out, lse, L, S, scale, CAUSAL=causal, HEAD_DIM=d)
    else:
        block_q, block_k = blocks
        flash_forward_kernel[(triton.cdiv(L, block_q), B * H)](
            q3, k3, v3, out, lse, L, S, scale,
            CAUSAL=causal, BLOCK_Q=block_q, BLOCK_K=block_k, HEAD_DIM=d)
    return out.reshape(B, H, L, d), lse.reshape(B, H, L)


def naive_attention(q, k, v, causal=False):
    """The reference: full score matrix, bottom-right causal mask, empty rows -> 0."""
    L, S = q.shape[-2], k.shape[-2]
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v.float(), lse


def interpret_check():
    """Run the kernel under TRITON_INTERPRET=1 on small inputs; return the worst error."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("flash_gpu: --interpret-check needs TRITON_INTERPRET=1 (set automatically "
                 "when no CUDA GPU is present).")
    torch.manual_seed(0)
    worst = 0.0
    print(f"{'L':>4} {'S':>4} {'d':>4} {'causal':>6}  {'max|out err|':>12} {'max|lse err|':>12}")
    for L, S, d, causal in [(64, 64, 32, False), (100, 130, 16, True), (130, 100, 64, True),
                            (37, 37, 128, False), (5, 1, 16, True)]:
        q, k, v = torch.randn(1, 2, L, d), torch.randn(1, 2, S, d), torch.randn(1, 2, S, d)
        out, lse = flash_attention_triton(q, k, v, causal, blocks=(32, 32))
        ref_out, ref_lse = naive_attention(q, k, v, causal)
        finite = torch.isfinite(ref_lse)
        if not torch.equal(finite, torch.isfinite(lse)):
            sys.exit("flash_gpu: the kernel's -inf logsumexp rows differ from the reference")
        out_err = (out - ref_out).abs().max().item()
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        worst = max(worst, out_err, lse_err)
        print(f"{L:>4} {S:>4} {d:>4} {str(causal):>6}  {out_err:>12.1e} {lse_err:>12.1e}")
    print(f"\ninterpret_max_error={worst:.3e}")
    return worst


def attention_tflops(length, head_dim, batch, heads, causal, milliseconds):
    flops = 4 * length * length * head_dim * batch * heads / (2 if causal else 1)
    return flops / (milliseconds * 1e-3) / 1e12


def benchmark():
    print(f"machine: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, "
          f"torch {torch.__version__}, triton {triton.__version__}, "
          f"Python {platform.python_version()}")
    print(f"fp16, {TOKENS} tokens per batch, model width {MODEL_WIDTH}, "
          f"TFLOP/s = 4*N^2*d per head (/2 causal) / median time\n")
    print(f"{'N':>6} {'d':>4} {'causal':>6} {'B':>3} {'H':>3} {'max|err|':>9} "
          f"{'triton ms':>10} {'TFLOP/s':>8} {'SDPA ms':>9} {'TFLOP/s':>8} {'triton/SDPA':>12}",
          flush=True)
    results = []
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            for length in LENGTHS:
                batch, heads = TOKENS // length, MODEL_WIDTH // head_dim
                torch.manual_seed(0)
                q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda",
                                       dtype=torch.float16) for _ in range(3))

                def ours(q=q, k=k, v=v, causal=causal):
                    return flash_attention_triton(q, k, v, causal)[0]

                def theirs(q=q, k=k, v=v, causal=causal):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                error = (ours().float() - theirs().float()).abs().max().item()
                ours_ms = triton.testing.do_bench(ours, return_mode="median")
                theirs_ms = triton.testing.do_bench(theirs, return_mode="median")
                ours_tflops = attention_tflops(length, head_dim, batch, heads, causal, ours_ms)
                theirs_tflops = attention_tflops(length, head_dim, batch, heads, causal, theirs_ms)
                results.append((length, head_dim, causal, ours_tflops, theirs_tflops))
                print(f"{length:>6} {head_dim:>4} {str(causal):>6} {batch:>3} {heads:>3} "
                      f"{error:>9.1e} {ours_ms:>10.3f} {ours_tflops:>8.1f} {theirs_ms:>9.3f} "
                      f"{theirs_tflops:>8.1f} {ours_tflops / theirs_tflops:>12.2f}", flush=True)
                del q, k, v
    print()
    for length, head_dim, causal, ours_tflops, theirs_tflops in results:
        tag = f"n{length}_d{head_dim}_{'causal' if causal else 'full'}"
        print(f"triton_tflops_{tag}={ours_tflops:.2f}")
        print(f"sdpa_flash_tflops_{tag}={theirs_tflops:.2f}")
        print(f"triton_over_sdpa_{tag}={ours_tflops / theirs_tflops:.4f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret-check", action="store_true",
                        help="no GPU needed: check the kernel in Triton's interpreter")
    args = parser.parse_args(argv)
    if args.interpret_check:
        interpret_check()
    elif not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
    else:
        benchmark()


if __name__ == "__main__":
    main()
