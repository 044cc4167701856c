"""The rules' judgements, in the grading process: the numbers an adapter measured (`rules.measure`)
or the fork server measured from outside (`observe.CallCost`) held against their limits.

Equal values cannot show that an attention kernel never builds the full score matrix, or
skips the blocks that a causal mask hides. An adapter therefore measures the learner's call and
reports numbers as observations; a test then judges them with the `Rule` against a limit. The
limit is read from the reference's observations (the same adapter computes it from the
inputs), never from the process that ran the learner's code. `whole_scores` and `work_time`
judge what the fork server measured from outside the learner's processes: how far their memory
rose during a call, what they read or wrote of the memory they held, and the CPU time they spent
(`sandbox.cost.CostWatch`), which also sees a process start or end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable

from autograde.observe import CallCost
from autograde.rules import measure


@dataclass(frozen=True)
class Rule:
    """A rule on how a result is computed, which equal values cannot show (memory, work, ...).

    The adapter reports what the rule needs as observations named in `keys`; a test holds them
    against the limits with `autograde.testing.assert_rule`, which calls `judge(expected, got)`:
    the problems found, each naming the rule and saying by how much it is broken. Limits are
    read from `expected`, computed by the same adapter on the reference's side.
    """

    name: str
    keys: tuple[str, ...]
    judge: Callable[[dict, dict], list[str]]


def _number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def memory(function: str) -> Rule:
    """The memory rule of the flash exercises, on the keys `measure.memory_keys` names."""
    largest, limit = measure.memory_keys(function)

    def judge(expected: dict, got: dict) -> list[str]:
        measured, allowed = got[largest], expected[limit]
        if not _number(measured):
            return [f"memory rule: `{largest}` should be a number, got {measured!r}"]
        if measured <= allowed:
            return []
        return [f"memory rule broken: the largest tensor created by {function} holds {measured:,} elements, "
                f"{measured / allowed:.3g}x the {allowed:,} allowed ({limit}); the reference's largest holds "
                f"{expected[largest]:,}. Work on one block of scores at a time: never all L x S at once."]

    return Rule("memory", (largest,), judge)


def whole_scores(call: str, peak: CallCost, scores: int) -> list[str]:
    """The problems with `peak`, measured during `call`, for inputs with `scores` attention scores
    (B * H * L * S): the memory it gained and the writable memory it read or wrote, together, must
    stay below what all of them would take at two bytes each.

    A stored float32 or float16 score matrix breaks it, whether in one tensor, in blocks kept (say,
    on `ctx`), in a buffer allocated before the call or in another process; working memory of the
    size of q, k, v, or of the output once per key block of at least 2 d columns, stays well below
    it (new pages count twice, gained and written: about 10 MiB for the reference's forward)."""
    if peak.problem:
        return [f"whole-scores rule: {peak.problem}"]
    allowed = 2 * scores
    if peak.growth_bytes is not None and peak.growth_bytes + peak.referenced_bytes < allowed:
        return []
    return [f"whole-scores rule broken: during {call} your notebook's processes gained "
            f"{peak.growth_bytes / 2**20:.0f} MiB of memory and read or wrote {peak.referenced_bytes / 2**20:.0f} MiB "
            f"of the writable memory they held ({peak.where}); all {scores:,} scores would take "
            f"{allowed / 2**20:.0f} MiB at two bytes each, {2 * allowed / 2**20:.0f} MiB as float32. "
            "Keep one block of scores at a time, and do not keep the blocks either."]


def rolling_storage(call: str, cost: CallCost, slots_bytes: int, appended_bytes: int, allowed: float) -> list[str]:
    """The problems with `cost`, measured during `call`, which fed a rolling cache `appended_bytes` of keys and
    values: the memory its processes gained must stay within `allowed` times the `slots_bytes` of the cache's
    slots. The slots and the chunk being appended take about 1.5x; keeping the tokens appended, 10 windows of
    them, takes 11x; reallocating the slots at every append, up to about 4x."""
    if cost.problem:
        return [f"storage rule: {cost.problem}"]
    if cost.growth_bytes is not None and cost.growth_bytes <= allowed * slots_bytes:
        return []
    return [f"storage rule broken: during {call} your notebook's processes gained {cost.growth_bytes / 2**20:.0f} MiB "
            f"of memory ({cost.where}), {cost.growth_bytes / slots_bytes:.1f}x the {slots_bytes / 2**20:.0f} MiB of "
            f"the cache's slots; at most {allowed:g}x is allowed, and the {appended_bytes / 2**20:.0f} MiB appended "
            "would not fit. Keep the sinks and the last `window` tokens in slots allocated once, and let the "
            "tokens that leave the window go."]


def work_time(call: str, causal: list[CallCost], full: list[CallCost], allowed: float) -> list[str]:
    """The problems with the CPU time of `call` measured with causal=True (`causal`) and with
    causal=False (`full`), in pairs (a causal call, then a full one): in the median pair, the causal
    call must take at most `allowed` times the full one. A pair's two calls meet the same machine, a
    neighbour's load slowing both; the median leaves out a pair whose calls met different ones.

    Skipping the key blocks wholly above the diagonal halves the work at L = S (0.6x to 0.7x for
    the reference at L = S = 2048, d = 128, blocks 128, its fixed costs included; up to 0.82x for
    an answer that also masks every block it computes); masking them keeps all of it, however it is
    computed."""
    problems = [cost.problem for cost in causal + full if cost.problem]
    if problems:
        return [f"work rule: {problems[0]}"]
    if any(cost.cpu_seconds <= 0 for cost in full):
        return [f"work rule: no CPU time measured for {call} with causal=False"]
    pairs = sorted(zip(causal, full, strict=True), key=lambda pair: pair[0].cpu_seconds / pair[1].cpu_seconds)
    median_causal, median_full = (cost.cpu_seconds for cost in pairs[(len(pairs) - 1) // 2])
    measured = median_causal / median_full
    if measured <= allowed:
        return []
    return [f"work rule broken: {call} took {median_causal:.3f} s of CPU time with causal=True, {measured:.2g}x the "
            f"{median_full:.3f} s with causal=False (the median of {len(pairs)} pairs of calls, {causal[0].where}); "
            f"at most {allowed:g}x is allowed. Skip the key blocks wholly above the diagonal instead of computing "
            "and masking them."]


def work() -> Rule:
    """The work rule of `flash_attention_forward`, on the keys `measure.work_keys` names."""
    causal, full, allowed = measure.work_keys()

    def judge(expected: dict, got: dict) -> list[str]:
        if not (_number(got[causal]) and _number(got[full])):
            return [f"work rule: the FLOP counts should be numbers, got {got[causal]!r} and {got[full]!r}"]
        if got[full] <= 0:
            return ["work rule: no matmul FLOPs counted with causal=False: compute the scores and the output "
                    "with matrix products (`@`, `torch.matmul`, `torch.einsum`), the operations counted"]
        measured = got[causal] / got[full]
        if measured <= expected[allowed]:
            return []
        return [f"work rule broken: with causal=True the forward spends {got[causal]:,} matmul FLOPs, "
                f"{measured:.3g}x the {got[full]:,} of causal=False; at most {expected[allowed]:g}x is allowed "
                f"(the reference: {expected[causal] / expected[full]:.3g}x). Skip the key blocks wholly above "
                "the diagonal instead of computing and masking them."]

    return Rule("work", (causal, full, allowed), judge)


def saved(function: str) -> Rule:
    """The rule on what `function`'s forward saves for the backward (`measure.saved_key`)."""
    key = measure.saved_key(function)

    def judge(expected: dict, got: dict) -> list[str]:
        if got[key] == expected[key]:
            return []
        return [f"saved-tensors rule broken: {function}'s forward saves {got[key]}; it must save exactly "
                f"{expected[key]}, and the backward recomputes the probabilities block by block from lse."]

    return Rule("saved tensors", (key,), judge)


def by_hand(function: str) -> Rule:
    """The rule that `function` computes its gradients by hand: no autograd graph recorded while it
    runs (`measure.AutogradRecorded`, reported under `measure.by_hand_key`)."""
    key = measure.by_hand_key(function)

    def judge(expected: dict, got: dict) -> list[str]:
        if _number(got[key]) and got[key] == 0:
            return []
        return [f"hand-written backward rule broken: during {function}, autograd recorded a graph to differentiate "
                f"({got[key]!r} tensors saved for its backward); the gradients are the exercise: compute them by "
                "hand, block by block, not with torch.autograd.grad or .backward() on a recomputed forward."]

    return Rule("hand-written backward", (key,), judge)


def launched(function: str) -> Rule:
    """The rule that `function` computes with a Triton kernel, on the keys `measure.launched_keys`
    names: the launches that ran to the end, which
    results hold values a launch stored (all it stored in one tensor, or a part: a view, slice or
    copy), and the most values one PyTorch reduction combined outside
    the kernels (the wrapper should only allocate, reshape and launch), with that reduction under
    `outside_key + " (call)"`."""
    launches, written, outside = measure.launched_keys(function)

    def judge(expected: dict, got: dict) -> list[str]:
        if not (_number(got[launches]) and got[launches] >= 1):
            return [f"Triton rule broken: {function} launched {got[launches]!r} Triton kernels; the result must "
                    "come from a `@triton.jit` kernel launched as `kernel[grid](...)`."]
        problems = []
        if got[written] != expected[written]:
            problems.append(f"Triton rule broken: of the results of {function}, {expected[written]} should hold "
                            f"values a Triton kernel stored in a tensor it was given, and {got[written]} do; the "
                            "kernel must store the results (`tl.store`) in tensors the wrapper returns (or views, "
                            "slices or copies of part of them).")
        if not (_number(got[outside]) and got[outside] <= expected[outside]):
            problems.append(f"Triton rule broken: outside its kernels, {function} combined {got[outside]!r} "
                            f"values in one PyTorch reduction ({got.get(outside + ' (call)', 'a reduction')}); "
                            "the scores, the softmax and the products with v belong in the kernel, and the "
                            "wrapper only allocates, reshapes and launches.")
        return problems

    return Rule("Triton kernel", (launches, written, outside, outside + " (call)"), judge)


def reductions(function: str) -> Rule:
    """The rule that `function` reads its input in blocks, on the keys `measure.reduction_keys`
    names; the probe also reports the widest call under `widest_key + " (call)"`."""
    widest, limit = measure.reduction_keys(function)

    def judge(expected: dict, got: dict) -> list[str]:
        measured, allowed = got[widest], expected[limit]
        if not _number(measured):
            return [f"block rule: `{widest}` should be a number, got {measured!r}"]
        if measured <= allowed:
            return []
        return [f"block rule broken: one reduction in {function} combined {measured:,} values "
                f"({got.get(widest + ' (call)', 'a reduction')}), more than the block_size={allowed:,} columns of "
                "one block. Read the row one block of columns at a time: a running max and a running sum, "
                "updated block by block, never a max or a sum over the whole row."]

    return Rule("block", (widest,), judge)


def keys_in_blocks(function: str) -> Callable[[dict, dict], str | None]:
    """A tiled forward reads the keys one block at a time: no reduction combines more values than
    a block of keys or a head's width. The contract bounds the memory, not this, so a forward that
    reduces over every key at once (attention computed a few query rows at a time, with no online
    softmax) keeps its points and is sent for review: `finding(expected, got)`, on the keys
    `measure.keys_in_blocks_keys` names, is the reason to review, or None."""
    widest, limit = measure.keys_in_blocks_keys(function)

    def finding(expected: dict, got: dict) -> str | None:
        measured, allowed = got.get(widest), expected[limit]
        if not _number(measured) or measured <= allowed:
            return None
        return (f"{function} combined {measured:,} values in one reduction ({got.get(widest + ' (call)', 'one')}), "
                f"more than a block of keys or a head's width ({allowed:,}): it may compute attention over every "
                "key at once, a few query rows at a time, where the exercise reads the keys block by block "
                "with an online softmax")

    return finding
