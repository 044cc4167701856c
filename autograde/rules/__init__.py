"""Rules on how a result is computed, beyond its values: measured by an adapter, judged by a test.

`measure` runs in the learner's process (the worker's adapters): what a call created, computed,
saved, launched and reduced, reported under the names its `*_keys` functions give. `judge` runs in
the grading process: the `Rule`s that hold those numbers, and the costs the fork server measured
from outside, against their limits. The two sit in different layers (autograde/README.md), so
this package re-exports neither: import the one you need.
"""
