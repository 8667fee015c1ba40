PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test bench demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

# Two workers: the interpret-mode tests are CPU-bound, ~35% less wall time on two cores. Work
# stealing keeps both busy to the end (test times range from 0.1 s to 34 s).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

bench: $(STAMP)
	$(PY) -m benchmarks.decode $(BENCH_FLAGS)

demo: $(STAMP)
	$(PY) -m examples.smollm2 $(DEMO_FLAGS)

clean:
	rm -rf $(VENV) *.egg-info
