# `make run` and `make test` do all the set-up: they create .venv if it is missing, install the
# project with its dev extras (CPU torch where there is no GPU), then run the main job or the tests.
# `make test` also builds .venv-newest (the newest triton and transformers pip resolves inside the
# pyproject ranges) and runs the tests that touch either library there again.
PYTHON ?= python3
VENV   ?= .venv
NEWEST ?= .venv-newest
PY     := $(VENV)/bin/python
PY_NEWEST := $(NEWEST)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# No GPU: pin the CPU build of torch (on local disk) instead of letting pip pull a multi-GB CUDA one.
# .venv also pins the oldest supported triton / transformers, .venv-newest only torch.
CONSTRAINTS := $(if $(HAS_GPU),,-c requirements/cpu-constraints.txt)
CONSTRAINTS_NEWEST := $(if $(HAS_GPU),,-c requirements/cpu-newest-constraints.txt)
STAMP := $(VENV)/.oxygen-installed
STAMP_NEWEST := $(NEWEST)/.oxygen-installed
DEPS := pyproject.toml setup.py $(wildcard csrc/*)
# The tests that run on both ends of the range: kernels (the Triton interpreter), compile, HF,
# and every other test file that imports transformers or the HF integration, or calls enable()
# (which installs the integration where transformers is present).
RANGE_IMPORTS := (from|import) transformers|oxygen_torch\.(integrations|enable\()
RANGE_TESTS := $(sort $(wildcard tests/test_kernels_*.py tests/test_ops*.py tests/test_hf_*.py \
	tests/test_compile*.py) $(shell grep -lE '$(RANGE_IMPORTS)' tests/test_*.py))
VERSIONS := import torch, triton, transformers as t; \
	print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {t.__version__}")

.PHONY: run test test-oldest test-newest lint doctor clean

# venv, python, constraints file
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q $(2) -e ".[dev]"
	touch $(1)/.oxygen-installed
endef

$(STAMP): $(DEPS) requirements/cpu-constraints.txt
	$(call install,$(VENV),$(CONSTRAINTS))

$(STAMP_NEWEST): $(DEPS) requirements/cpu-newest-constraints.txt
	$(call install,$(NEWEST),$(CONSTRAINTS_NEWEST))

run: $(STAMP)
	$(PY) examples/generate.py

# Both runs always run, side by side (one core each on CI's 2-core machine: 32 minutes one after
# the other, 18-21 together, 2026-12-04), the newest one's output printed after the oldest's;
# the target fails if either fails (pytest's status 5, no tests collected, included). One torch
# thread per run: two runs each spinning two OpenMP threads on two cores slow each other down.
# The newest run is a process group of its own (a background job ignores Ctrl-C): interrupted,
# it goes too.
NEWEST_LOG := $(NEWEST)/last-test.log
test: $(STAMP) $(STAMP_NEWEST)
	@status=0; \
	OMP_NUM_THREADS=1 setsid $(MAKE) --no-print-directory test-newest > $(NEWEST_LOG) 2>&1 & \
	newest=$$!; \
	trap 'kill -TERM -$$newest 2>/dev/null; exit 130' INT TERM; \
	OMP_NUM_THREADS=1 $(MAKE) --no-print-directory test-oldest || status=1; \
	wait $$newest || status=1; \
	cat $(NEWEST_LOG); \
	exit $$status

test-oldest: $(STAMP)
	@echo "== whole suite, oldest supported: $$($(PY) -c '$(VERSIONS)')"
	$(PY) -m pytest -q --durations=30

test-newest: $(STAMP_NEWEST)
	@echo "== kernel and transformers tests, newest: $$($(PY_NEWEST) -c '$(VERSIONS)')"
	$(PY_NEWEST) -m pytest -q --durations=30 -o cache_dir=$(NEWEST)/.pytest_cache $(RANGE_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

doctor: $(STAMP)
	$(PY) -m oxygen_torch doctor

clean:
	rm -rf build *.egg-info oxygen_torch/_oxygen.so $(VENV) $(NEWEST)
