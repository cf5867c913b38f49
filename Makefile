# `make run` and `make test` do all the set-up: they create .venv if it is missing, install the
# project with its dev extras (CPU torch where there is no GPU), then run the main job or the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# No GPU: pin the CPU build of torch (on local disk) instead of letting pip pull a multi-GB CUDA one.
CONSTRAINTS := $(if $(HAS_GPU),,-c requirements/cpu-constraints.txt)
STAMP := $(VENV)/.oxygen-installed

.PHONY: run test lint doctor clean

$(STAMP): pyproject.toml setup.py requirements/cpu-constraints.txt $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[dev]"
	touch $@

run: $(STAMP)
	$(PY) examples/generate.py

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

doctor: $(STAMP)
	$(PY) -m oxygen_torch doctor

clean:
	rm -rf build *.egg-info oxygen_torch/_oxygen.so $(VENV)
