# Two commands on a fresh machine: `make book` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; on a machine with a local CPU wheel this downloads no CUDA packages.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
JB_FLAGS := -W -n --keep-going
# open: the book as published, into _build/html. class: without the graded answers
# (tools/class_edition.py), into a build folder and execution cache of its own.
EDITION ?= open
CLASS_BUILD := _build/class

.PHONY: book book-class test test-grader lint exercises benchmark clean

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" -r requirements-dev.txt
	touch $@

book: $(STAMP)
ifeq ($(EDITION),open)
	$(VENV)/bin/jupyter-book build . $(JB_FLAGS)
else ifeq ($(EDITION),class)
	BOOK_EDITION=class $(VENV)/bin/jupyter-book build . $(JB_FLAGS) --path-output $(CLASS_BUILD)
	touch $(CLASS_BUILD)/built
else
	$(error EDITION is open or class, not $(EDITION))
endif

book-class:
	$(MAKE) book EDITION=class

test: book book-class lint
	$(PY) -m pytest

# The grader's tests alone, without building the book: the exercises' tests on the solutions,
# then the repository's tests of the grader and the exercises.
test-grader: lint
	$(PY) -m pytest autograde/tests --seed 12345 -q
	$(PY) -m pytest tests --ignore=tests/test_site.py --ignore=tests/test_course_layout.py

lint: $(STAMP)
	$(VENV)/bin/ruff check autograde tests benchmarks tools

exercises: $(STAMP)
	$(PY) -m autograde release

benchmark: $(STAMP)
	$(PY) -m benchmarks.book_build

clean:
	rm -rf _build
