# Strata: `make demo` runs the whole system, `make test` runs the tests. Both set up what they need.
SHELL := /bin/bash
PYTHON_BIN ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench bench-scale lint stop clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON_BIN) >/dev/null || { echo "Strata needs Python 3.11 ($(PYTHON_BIN) not found)"; exit 1; }
	@test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m controlplane.runtime.demo run

stop:
	@test -x $(PY) && $(PY) -m controlplane.runtime.demo stop || echo "nothing to stop (no $(VENV))"

test: setup
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m pytest -q --ds=controlplane.settings.test

bench: setup
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m benchmarks

bench-scale: setup  # the directory at 10M blocks (the full-size run is 1M)
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m benchmarks directory --scale 10

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy controlplane worker

clean: stop
	rm -rf var $(VENV) .pytest_cache .ruff_cache .mypy_cache benchmarks/results
