"""Reading a submission: load the notebook, verify it against the release, extract its code, scan it."""
