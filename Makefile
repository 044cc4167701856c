# Two commands on a fresh machine: `make book` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; on a machine with a local CPU wheel this downloads no CUDA packages.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
JB_FLAGS := -W -n --keep-going

.PHONY: book test exercises benchmark clean

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" -r requirements-dev.txt
	touch $@

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . $(JB_FLAGS)

test: book
	$(PY) -m pytest

exercises: $(STAMP)
	$(PY) -m autograde release

benchmark: $(STAMP)
	$(PY) -m benchmarks.book_build

clean:
	rm -rf _build
