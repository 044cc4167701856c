"""The exercises' definitions, one module each: its `EXERCISE` and the `@adapter` calls its tests make
on a submission, run in the learner's process. `autograde.registry` finds them; their tests are
`autograde/tests/test_<id>.py`."""
