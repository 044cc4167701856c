"""Running learner code: the fork server's client and server, the isolation, the worker, and the
result format (what crosses back from the worker: observations as .npy arrays and JSON, never pickle)."""
