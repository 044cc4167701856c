"""Grading: the tests run by pytest on a submission, the comparisons, the journal, the reports, a class."""
