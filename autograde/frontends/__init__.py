"""The front ends: the command line, check() in a notebook, nbgrader's test cells, Gradescope, the release."""
