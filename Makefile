PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extra pytest arguments for the test targets, e.g. make test PYTEST_FLAGS="-x -k paged".
PYTEST_FLAGS ?=
# Persistent compilation cache of make test-gpu: later runs skip the Mosaic GPU / Triton compiles.
JAX_CACHE_DIR ?= .jax_cache

.PHONY: test test-slow test-experimental test-gpu test-all bench demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

# Two workers: the interpret-mode tests are CPU-bound, ~35% less wall time on two cores. Work
# stealing keeps both busy to the end. Tests marked slow or experimental (opt-in kernel variants,
# not shipped defaults) are left out: make test-slow and make test-experimental run them.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow and not experimental" $(PYTEST_FLAGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "slow" $(PYTEST_FLAGS)

test-experimental: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "experimental" $(PYTEST_FLAGS)

# Everything, markers or not (gpu tests skip where no GPU is present).
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal $(PYTEST_FLAGS)

# On a GPU machine: one process (one GPU), jax's persistent compilation cache in $(JAX_CACHE_DIR); a
# representative case of each axis (the whole products are marked slow: make test-slow on a GPU).
test-gpu: $(STAMP)
	JAX_COMPILATION_CACHE_DIR=$(JAX_CACHE_DIR) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 $(PY) -m pytest -q -m "gpu and not experimental and not slow" $(PYTEST_FLAGS)

bench: $(STAMP)
	$(PY) -m benchmarks.decode $(BENCH_FLAGS)

demo: $(STAMP)
	$(PY) -m examples.smollm2 $(DEMO_FLAGS)

clean:
	rm -rf $(VENV) *.egg-info
