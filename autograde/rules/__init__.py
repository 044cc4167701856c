"""Rules on how a result is computed, beyond its values: measured by an adapter, judged by a test.

`measure` runs in the learner's process (the worker's adapters): what a call created, computed,
saved, launched and reduced. `judge` runs in the grading process: the `Rule`s that hold those
numbers, and the costs the fork server measured from outside, against their limits. Test modules
use both through this package's names.
"""

from autograde.rules.judge import (
    Rule,
    by_hand,
    keys_in_blocks,
    launched,
    memory,
    reductions,
    saved,
    whole_scores,
    work,
    work_time,
)
from autograde.rules.measure import AutogradRecorded, Footprint, Reductions, TritonLaunches, saved_for_backward

__all__ = ["AutogradRecorded", "Footprint", "Reductions", "Rule", "TritonLaunches", "by_hand", "keys_in_blocks",
           "launched", "memory", "reductions", "saved", "saved_for_backward", "whole_scores", "work", "work_time"]
