"""The exercises' tests: one pytest module per exercise (see conftest.py)."""
