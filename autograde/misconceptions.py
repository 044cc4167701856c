"""Known misconceptions, named when a visible test fails: "your output equals attention scaled by
1/d instead of 1/√d".

Each misconception is a wrong version of some of an exercise's functions, made from the
solution's own (`overrides`: a function of the solution's function), so that this module holds
no answer of its own. When a visible test's `assert_same` fails, the grading process (never the
learner's) makes the test's reference calls again, in float64, on the solution cells with the
misconception's functions in place, and holds the learner's result against that: when it agrees
where the reference's did not, the failure names the misconception. Adapters run as they do on
the reference, so a misconception in `split_heads` shows in `MultiHeadAttention`'s output too.

Only where the course's solutions are (the instructor's grader, `check()` in the course's own
folder): a class's copy without `solutions/` names none.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from autograde import course, solutions
from autograde.cases import float_copy
from autograde.observe import TensorValue


@dataclass(frozen=True, eq=False)
class Misconception:
    exercise: str
    name: str
    says: str  # what the learner's output equals, in the course's words
    # function name -> the wrong function, made from the solution's function of that name
    overrides: Mapping[str, Callable[[Callable], Callable]]


# Wrong versions made from the solution's functions.

def _queries_scaled(factor: Callable[[int], float]) -> Callable[[Callable], Callable]:
    """Attention whose scores are scaled by 1/√d times `factor(d)` (the solution divides by √d): any
    attention function whose first argument is q, its other arguments passed as they come."""
    def wrong(attention):
        def scaled(q, *arguments, **options):
            return attention(q * factor(q.shape[-1]), *arguments, **options)
        return scaled
    return wrong


def _mask_inverted(attention):
    def inverted(q, k, v, mask=None):
        if mask is None:
            return attention(q, k, v)
        _, weights = attention(q, k, v, ~mask)
        # Read so, a row of True has no key left: its softmax is of -inf alone, NaN. The contract's
        # fully masked rows (no True) stay zeroed, as the learner's own code still reads them.
        weights = weights.masked_fill(mask.all(dim=-1, keepdim=True), math.nan)
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
        return weights @ v, weights
    return inverted


def _softmax_over_queries(attention):
    def over_queries(q, k, v, mask=None):
        # The solution's weights of the keys attending to the queries: a softmax over the queries.
        _, transposed = attention(k, q, q, None if mask is None else mask.transpose(-2, -1))
        weights = transposed.transpose(-2, -1)
        return weights @ v, weights
    return over_queries


def _top_left_causal_mask(causal_mask):
    def top_left(L, S=None, device=None):
        return torch.ones(L, L if S is None else S, dtype=torch.bool, device=device).tril()
    return top_left


def _split_without_transpose(split_heads):
    def without_transpose(x, num_heads):
        split_heads(x, num_heads)  # its ValueError, where the width does not divide
        batch, tokens, width = x.shape
        return x.reshape(batch, num_heads, tokens, width // num_heads)
    return without_transpose


def _merge_without_transpose(merge_heads):
    def without_transpose(x):
        batch, heads, tokens, head_dim = x.shape
        return x.reshape(batch, tokens, heads * head_dim)
    return without_transpose


def _query_and_key_swapped(load_torch_mha):
    def swapped(module, torch_mha):
        loaded = load_torch_mha(module, torch_mha)
        with torch.no_grad():
            for name in ("weight", "bias"):
                q, k = getattr(loaded.q_proj, name), getattr(loaded.k_proj, name)
                if q is not None:
                    held = q.clone()
                    q.copy_(k)
                    k.copy_(held)
        return loaded
    return swapped


def _tiled_kv(repeat_kv):
    def tiled(x, n_rep):
        repeat_kv(x, n_rep)  # its checks
        return x.repeat(1, n_rep, 1, 1)
    return tiled


def _new_tokens_only(step):
    def new_only(module, x_new, cache=None):
        return step(module, x_new)[0], step(module, x_new, cache)[1]
    return new_only


def _with_projections(change: Callable[[torch.nn.Module], None]) -> Callable[[Callable], Callable]:
    """A decoding step on a copy of the module whose projections `change` altered."""
    def wrong(step):
        def on_a_copy(module, x_new, cache=None):
            altered = copy.deepcopy(module)
            with torch.no_grad():
                change(altered)
            return step(altered, x_new, cache)
        return on_a_copy
    return wrong


def _biases_dropped(module) -> None:
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(module, name).bias is not None:
            getattr(module, name).bias.zero_()


def _queries_times_sqrt_d(module) -> None:  # scores times √d: as if they were not divided by it
    for parameter in module.q_proj.parameters():
        parameter.mul_(math.sqrt(module.head_dim))


def _lse_as_max(merge):
    def as_max(out_a, lse_a, out_b, lse_b):
        return merge(out_a, lse_a, out_b, lse_b)[0], torch.maximum(lse_a, lse_b)
    return as_max


def _equal_weights(merge):
    def equal(out_a, lse_a, out_b, lse_b):
        both = torch.isfinite(lse_a) & torch.isfinite(lse_b)  # with one side empty, the other is the answer
        out, lse = merge(out_a, lse_a, out_b, lse_b)
        average = merge(out_a, torch.zeros_like(lse_a), out_b, torch.zeros_like(lse_b))[0]
        return torch.where(both[..., None], average, out), lse
    return equal


def _kv_heads_tiled(attention):
    """Query head i reads key and value head i mod H_kv (the heads repeated as a block) instead of i // group;
    keys and values hold their heads in dimension 1, as the queries do."""
    def tiled(q, k, v, *rest, **named):
        times = [1] * k.dim()
        times[1] = q.shape[1] // k.shape[1]
        return attention(q, k.repeat(*times), v.repeat(*times), *rest, **named)
    return tiled


def _pages_sorted(attention):
    def sorted_pages(q, k_pages, v_pages, block_table, seq_lens):
        table = block_table.clone()
        for row, length in enumerate(seq_lens.tolist()):
            used = -(-length // k_pages.shape[2])
            table[row, :used] = table[row, :used].sort().values
        return attention(q, k_pages, v_pages, table, seq_lens)
    return sorted_pages


def _whole_last_page(attention):
    def whole(q, k_pages, v_pages, block_table, seq_lens):
        page_size = k_pages.shape[2]
        return attention(q, k_pages, v_pages, block_table, -(-seq_lens // page_size) * page_size)
    return whole


def _at_last_cached_position(append):
    def at_last(k_pages, v_pages, block_table, seq_lens, k_new, v_new):
        return append(k_pages, v_pages, block_table, (seq_lens - 1).clamp(min=0), k_new, v_new)
    return at_last


def _other_layout(apply_rope):
    def other(x, positions, base=10000.0, interleaved=False):
        return apply_rope(x, positions, base, not interleaved)
    return other


def _positions_from_zero(apply_rope):
    def from_zero(x, positions, base=10000.0, interleaved=False):
        positions = torch.as_tensor(positions)
        return apply_rope(x, positions - positions.reshape(-1)[0], base, interleaved)
    return from_zero


def _default_base(apply_rope):
    def default(x, positions, base=10000.0, interleaved=False):
        return apply_rope(x, positions, 10000.0, interleaved)
    return default


def _flash_top_left(forward):
    def top_left(q, k, v, causal=False, block_q=64, block_k=64):
        if causal and k.shape[-2] > q.shape[-2]:  # query i sees keys 0 .. i: the first L keys, bottom-right
            length = q.shape[-2]
            return forward(q, k[..., :length, :], v[..., :length, :], True, block_q, block_k)
        return forward(q, k, v, causal, block_q, block_k)
    return top_left


def _gradients_not_scaled(backward):
    """dq and dk without the scale: dS reaches q and k through scale * q k^T, so each is scaled once more."""
    def unscaled(q, k, v, out, lse, dout, causal=False, block_q=64, block_k=64):
        dq, dk, dv = backward(q, k, v, out, lse, dout, causal, block_q, block_k)
        root = math.sqrt(q.shape[-1])
        return dq * root, dk * root, dv
    return unscaled


def _delta_left_out(backward):
    """D = rowsum(dout * out) left out of dS = P * (dP - D): the solution given out = 0 computes exactly that."""
    def without_delta(q, k, v, out, lse, dout, causal=False, block_q=64, block_k=64):
        return backward(q, k, v, torch.zeros_like(out), lse, dout, causal, block_q, block_k)
    return without_delta


def _flash_backward_top_left(backward):
    """The causal mask aligned top-left in the backward: with S > L, query i sees keys 0 .. i, the first L."""
    def top_left(q, k, v, out, lse, dout, causal=False, block_q=64, block_k=64):
        length = q.shape[-2]
        if not (causal and k.shape[-2] > length):
            return backward(q, k, v, out, lse, dout, causal, block_q, block_k)
        dq, dk, dv = backward(q, k[..., :length, :], v[..., :length, :], out, lse, dout, True, block_q, block_k)
        rest = torch.zeros_like(k[..., length:, :])
        return dq, torch.cat([dk, rest], dim=-2), torch.cat([dv, rest], dim=-2)
    return top_left


def _triton_top_left(attention):
    """Query i sees keys 0 .. i: with S > L, the first L keys under the square mask; with L > S, the
    first S queries under it and the others every key."""
    def top_left(q, k, v, causal=False):
        L, S = q.shape[-2], k.shape[-2]
        if not causal or L == S:
            return attention(q, k, v, causal)
        if S > L:
            return attention(q, k[..., :L, :].contiguous(), v[..., :L, :].contiguous(), True)
        first, rest = attention(q[..., :S, :].contiguous(), k, v, True), attention(q[..., S:, :].contiguous(), k, v)
        return torch.cat([first[0], rest[0]], dim=-2), torch.cat([first[1], rest[1]], dim=-1)
    return top_left


def _latent_scaled_without_rope_dim(module_class):
    class ScaledByHeadDim(module_class):
        """Scores divided by √head_dim instead of √(head_dim + rope_dim): the queries scaled to match."""

        def forward(self, x, mask=None):
            factor = math.sqrt((self.head_dim + self.rope_dim) / self.head_dim)
            with torch.no_grad():
                self.q_proj.weight.mul_(factor)
            try:
                return super().forward(x, mask)
            finally:
                with torch.no_grad():
                    self.q_proj.weight.div_(factor)
    return ScaledByHeadDim


def _window_one_wider(mask):
    def wider(L, S, window):
        return mask(L, S, window + 1)
    return wider


def _window_top_left(mask):
    """The band measured from the top-left corner: query i sees i - window < j <= i, as if L were S."""
    def top_left(L, S, window):
        n = max(L, S)
        return mask(n, n, window)[:L, :S]
    return top_left


def _sink_in_the_numerator(attention):
    """The sink's weight added to every output entry, as if its value were all ones (the solution's
    output with values of ones is 1 less the sink's weight, in each row that attends something)."""
    def numerator(q, k, v, window, sink_logits=None):
        out = attention(q, k, v, window, sink_logits)
        if sink_logits is None:
            return out
        kept = attention(q, k, torch.ones_like(v[..., :1]), window, sink_logits)
        return out + (1 - kept)
    return numerator


# What the flash exercises' outputs may equal, said the same for the forward in PyTorch and in Triton.
SCALED_BY_D, NOT_SCALED = "attention scaled by 1/d instead of 1/√d", "attention without the 1/√d scaling"
TOP_LEFT = "a causal mask aligned top-left (key j <= query i) instead of bottom-right (j <= i + S - L)"

MISCONCEPTIONS: tuple[Misconception, ...] = (
    Misconception("sdpa", "scaled-by-d", "attention scaled by 1/d instead of 1/√d",
                  {"scaled_dot_product_attention": _queries_scaled(lambda d: 1 / math.sqrt(d))}),
    Misconception("sdpa", "not-scaled", "attention without the 1/√d scaling",
                  {"scaled_dot_product_attention": _queries_scaled(math.sqrt)}),
    Misconception("sdpa", "mask-inverted", "attention with the mask read the other way round (True = blocked); "
                                           "in the contract True means the query may attend to the key",
                  {"scaled_dot_product_attention": _mask_inverted}),
    Misconception("sdpa", "softmax-over-queries", "attention with the softmax taken over the queries (dim=-2) "
                                                  "instead of the keys (dim=-1): each row of weights must sum to 1",
                  {"scaled_dot_product_attention": _softmax_over_queries}),
    Misconception("sdpa", "top-left-causal-mask", "a causal mask aligned top-left (tril()) instead of bottom-right "
                                                  "(tril(S - L)): with S > L the last query sees every key",
                  {"causal_mask": _top_left_causal_mask}),
    Misconception("mha", "split-without-transpose", "heads split by reshaping (B, T, H*d) straight to (B, H, T, d), "
                                                    "without the transpose: each head mixes tokens",
                  {"split_heads": _split_without_transpose}),
    Misconception("mha", "merge-without-transpose", "heads merged by reshaping (B, H, T, d) straight to "
                                                    "(B, T, H*d), without transposing back first",
                  {"merge_heads": _merge_without_transpose}),
    Misconception("mha", "not-scaled", "multi-head attention without the 1/√d scaling (d: the head's width)",
                  {"scaled_dot_product_attention": _queries_scaled(math.sqrt)}),
    Misconception("mha", "query-and-key-swapped", "the query and key projections swapped when loading "
                                                  "nn.MultiheadAttention's in_proj (its order is q, k, v)",
                  {"load_torch_mha": _query_and_key_swapped}),
    Misconception("gqa", "kv-tiled", "key and value heads repeated as a block, x.repeat (h0, h1, h0, h1), instead "
                                     "of each head n_rep times in a row, repeat_interleave (h0, h0, h1, h1)",
                  {"repeat_kv": _tiled_kv}),
    Misconception("gqa", "not-scaled", "grouped-query attention without the 1/√d scaling",
                  {"scaled_dot_product_attention": _queries_scaled(math.sqrt)}),
    Misconception("gqa", "scaled-by-d", "grouped-query attention scaled by 1/d instead of 1/√d",
                  {"scaled_dot_product_attention": _queries_scaled(lambda d: 1 / math.sqrt(d))}),
    Misconception("kv_cache", "new-tokens-only", "attention over the new tokens alone: the cached keys and values "
                                                 "must be concatenated before the new queries attend to them",
                  {"gqa_decode_step": _new_tokens_only}),
    Misconception("kv_cache", "biases-dropped", "the projections applied without their biases "
                                                "(x @ weight.T alone; call the module's nn.Linear layers)",
                  {"gqa_decode_step": _with_projections(_biases_dropped)}),
    Misconception("kv_cache", "not-scaled", "decoding attention without the 1/√head_dim scaling",
                  {"gqa_decode_step": _with_projections(_queries_times_sqrt_d)}),
    Misconception("rope", "other-layout", "RoPE rotating the pairs of the other layout (interleaved (0, 1), (2, 3) "
                                          "against the two halves (i, i + d/2))",
                  {"apply_rope": _other_layout}),
    Misconception("rope", "positions-from-zero", "RoPE whose positions start at 0 at every step: the new tokens of "
                                                 "a decoding step are at positions t .. t + n - 1, after the cache",
                  {"apply_rope": _positions_from_zero}),
    Misconception("rope", "default-base", "RoPE with the default base 10000, whatever base (rope_base) was given",
                  {"apply_rope": _default_base}),
    Misconception("rope", "not-scaled", "rotary attention without the 1/√d scaling",
                  {"scaled_dot_product_attention": _queries_scaled(math.sqrt)}),
    Misconception("split_kv", "lse-as-max", "a merged lse that is the larger of the two, max(lse_a, lse_b), instead "
                                            "of log(exp(lse_a) + exp(lse_b))",
                  {"merge_attention_states": _lse_as_max}),
    Misconception("split_kv", "equal-weights", "states merged with equal weights, (out_a + out_b) / 2, instead of "
                                               "weights exp(lse_a - lse) and exp(lse_b - lse)",
                  {"merge_attention_states": _equal_weights}),
    Misconception("split_kv", "kv-heads-tiled", "query head i reading key and value head i mod H_kv instead of "
                                                "i // (H / H_kv) (repeat where repeat_interleave is meant)",
                  {"split_kv_attention": _kv_heads_tiled}),
    Misconception("paged_kv", "pages-sorted", "the sequence's pages read in the order of their numbers instead of "
                                              "the order of its row of the block table",
                  {"paged_attention": _pages_sorted}),
    Misconception("paged_kv", "whole-last-page", "attention over every slot of the last page, past seq_lens[b]",
                  {"paged_attention": _whole_last_page}),
    Misconception("paged_kv", "kv-heads-tiled", "query head i reading key and value head i mod H_kv instead of "
                                                "i // (H / H_kv) (repeat where repeat_interleave is meant)",
                  {"paged_attention": _kv_heads_tiled}),
    Misconception("paged_kv", "at-last-cached-position", "the new token written at position seq_lens[b] - 1, over "
                                                         "the last cached token, instead of at seq_lens[b]",
                  {"append_to_paged_cache": _at_last_cached_position}),
    Misconception("flash_forward", "scaled-by-d", SCALED_BY_D,
                  {"flash_attention_forward": _queries_scaled(lambda d: 1 / math.sqrt(d))}),
    Misconception("flash_forward", "not-scaled", NOT_SCALED,
                  {"flash_attention_forward": _queries_scaled(math.sqrt)}),
    Misconception("flash_forward", "top-left-causal", TOP_LEFT,
                  {"flash_attention_forward": _flash_top_left}),
    Misconception("flash_backward", "gradients-not-scaled", "dq and dk without the 1/√d scaling: the scores are "
                                                            "scale * q k^T, so dS reaches q and k times the scale",
                  {"flash_attention_backward": _gradients_not_scaled}),
    Misconception("flash_backward", "delta-left-out", "gradients whose dS is P * dP, without D = rowsum(dout * out): "
                                                      "the softmax's Jacobian has a second term, "
                                                      "dS = P * (dP - D)",
                  {"flash_attention_backward": _delta_left_out}),
    Misconception("flash_backward", "top-left-causal", "a backward whose causal mask is aligned top-left (key "
                                                       "j <= query i) instead of bottom-right (j <= i + S - L)",
                  {"flash_attention_backward": _flash_backward_top_left}),
    Misconception("flash_triton", "scaled-by-d", SCALED_BY_D,
                  {"flash_attention_triton": _queries_scaled(lambda d: 1 / math.sqrt(d))}),
    Misconception("flash_triton", "not-scaled", NOT_SCALED,
                  {"flash_attention_triton": _queries_scaled(math.sqrt)}),
    Misconception("flash_triton", "top-left-causal", TOP_LEFT,
                  {"flash_attention_triton": _triton_top_left}),
    Misconception("mla", "other-layout", "RoPE rotating the pairs of the other layout (interleaved (0, 1), (2, 3) "
                                         "against the two halves (i, i + d/2))",
                  {"apply_rope": _other_layout}),
    Misconception("mla", "default-base", "RoPE with the default base 10000, whatever rope_base was given",
                  {"apply_rope": _default_base}),
    Misconception("mla", "scaled-without-rope-dim", "scores divided by √head_dim instead of √(head_dim + rope_dim): "
                                                    "the rotary part of each query and key counts in the width too",
                  {"MultiHeadLatentAttention": _latent_scaled_without_rope_dim}),
    Misconception("window", "window-off-by-one", "a band of window + 1 keys (j >= i + S - L - window) instead of "
                                                 "window (j > i + S - L - window)",
                  {"sliding_window_mask": _window_one_wider}),
    Misconception("window", "top-left-alignment", "a band aligned top-left (i - window < j <= i) instead of "
                                                  "bottom-right (shifted by S - L): the last query must see the "
                                                  "last key",
                  {"sliding_window_mask": _window_top_left}),
    Misconception("window", "sink-in-the-numerator", "the sink's weight added to the output as well, as if its "
                                                     "value were ones: the sink joins the softmax's denominator "
                                                     "only (its value is 0)",
                  {"windowed_attention": _sink_in_the_numerator}),
)


def of(exercise_id: str) -> list[Misconception]:
    return [m for m in MISCONCEPTIONS if m.exercise == exercise_id]


@functools.cache
def _calls(misconception: Misconception):
    """The exercise's calls on a fresh run of the solution cells, the misconception's functions in place."""
    from autograde.registry import EXERCISES
    from autograde.sandbox.calls import LearnerCalls

    exercise = EXERCISES[misconception.exercise]
    names = solutions.namespace.__wrapped__(exercise)  # not the reference's own (cached) namespace
    for name, wrong in misconception.overrides.items():
        names[name] = wrong(names[name])
    return LearnerCalls(exercise, names)


class Recorder:
    """The reference calls of one visible test and what they returned, for `diagnose`."""

    def __init__(self, exercise_id: str):
        self.exercise_id = exercise_id
        self.calls: list[tuple[str, tuple, dict, Any]] = []


_recording: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("misconceptions", default=None)


def record(recorder: Recorder | None) -> contextvars.Token:
    """Make `recorder` the current test's (None: a test whose failures name no misconception)."""
    return _recording.set(recorder)


def stop(token: contextvars.Token) -> None:
    _recording.reset(token)


def recorded(name: str, args: tuple, kwargs: dict, result: Any) -> None:
    recorder = _recording.get()
    if recorder is not None:
        recorder.calls.append((name, args, kwargs, result))


def _pair(right: Any, wrong: Any, leaves: dict[int, TensorValue]) -> None:
    """Map each tensor of the reference's result to the misconception's tensor in its place."""
    if isinstance(right, TensorValue):
        if not isinstance(wrong, TensorValue):
            raise ValueError("not a tensor")
        leaves[id(right)] = wrong
    elif isinstance(right, dict):
        if not isinstance(wrong, dict) or wrong.keys() != right.keys():
            raise ValueError("other keys")
        for key in right:
            _pair(right[key], wrong[key], leaves)
    elif isinstance(right, (list, tuple)):
        if not isinstance(wrong, (list, tuple)) or len(wrong) != len(right):
            raise ValueError("other lengths")
        for a, b in zip(right, wrong):
            _pair(a, b, leaves)


def _substitute(expected: Any, leaves: dict[int, TensorValue]) -> Any:
    if isinstance(expected, TensorValue):
        return leaves.get(id(expected), expected)
    if isinstance(expected, dict):
        return {key: _substitute(value, leaves) for key, value in expected.items()}
    if isinstance(expected, (list, tuple)):
        return type(expected)(_substitute(value, leaves) for value in expected)
    return expected


def diagnose(got: Any, expected: Any, differences: Callable[[Any, Any], list[str]]) -> str | None:
    """The misconception whose output `got` equals (`differences` finds none) where it differs from
    `expected`, for the current test's reference calls; None if none matches, or none can be made here."""
    recorder = _recording.get()
    if recorder is None or not recorder.calls or not course.has_solutions():
        return None
    from autograde.observe import observe

    for misconception in of(recorder.exercise_id):
        leaves: dict[int, TensorValue] = {}
        try:
            for name, args, kwargs, result in recorder.calls:
                _pair(result, observe(_calls(misconception)(name, float_copy(args), float_copy(kwargs))), leaves)
        except Exception:  # a misconception that cannot make these calls explains nothing here
            continue
        if not differences(got, _substitute(expected, leaves)):
            return f"your output equals {misconception.says}"
    return None
