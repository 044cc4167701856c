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

.PHONY: book book-class test test-slow test-vm test-book test-all test-grader lint exercises benchmark clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" -r requirements-dev.txt
	touch $@

# The chapters are executed into the edition's execution cache one a core first (tools/execute_chapters.py):
# Jupyter Book executes them one after the other.
book: $(STAMP)
ifeq ($(EDITION),open)
	$(PY) tools/execute_chapters.py _build/.jupyter_cache
	$(VENV)/bin/jupyter-book build . $(JB_FLAGS)
else ifeq ($(EDITION),class)
	$(PY) tools/execute_chapters.py $(CLASS_BUILD)/_build/.jupyter_cache
	BOOK_EDITION=class $(VENV)/bin/jupyter-book build . $(JB_FLAGS) --path-output $(CLASS_BUILD)
	touch $(CLASS_BUILD)/built
else
	$(error EDITION is open or class, not $(EDITION))
endif

book-class:
	$(MAKE) book EDITION=class

# The tiers (pytest markers in pyproject.toml; README, "Tests"). `make test` is the fast tier: the
# open edition built strictly, ruff, and every test no marker sends elsewhere. Spread over two
# processes by default (pytest-xdist; each runs torch on one thread); TEST_PROCESSES=0 runs a tier in one.
TEST_PROCESSES ?= 2
PYTEST := $(PY) -m pytest $(if $(filter-out 0,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadgroup)
test: book lint
	$(PYTEST) --durations=20

# Seed sweeps, whole classes through the sandbox, attacks, nbgrader on every notebook, Slurm.
test-slow: $(STAMP)
	$(PYTEST) -m slow --durations=20

# The cgroup v2 tests in a virtual machine (needs root; QEMU and a Debian kernel installed with apt).
test-vm: $(STAMP)
	$(PY) -m pytest -m vm

# The class edition, built strictly, and what is checked on its site.
test-book: book-class
	$(PYTEST) -m book

test-all: test test-slow test-book test-vm

# The grader's tests alone, without building the book: the exercises' tests on the solutions,
# then the repository's tests of the grader and the exercises, every tier but the VM's.
test-grader: lint
	$(PY) -m pytest autograde/tests --seed 12345 -q
	$(PYTEST) -m "not vm and not book" --ignore=tests/test_site.py --ignore=tests/test_course_layout.py

lint: $(STAMP)
	$(VENV)/bin/ruff check autograde tests benchmarks tools

exercises: $(STAMP)
	$(PY) -m autograde release

benchmark: $(STAMP)
	$(PY) -m benchmarks.book_build

clean:
	rm -rf _build
