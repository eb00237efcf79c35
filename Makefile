# Quick start (each sets up .venv on first use: torch, the build, the test tools):
#   make train   the main job on its built-in default: a simulated cluster of 4 CPU workers of
#                different speeds trains a small GPT, then says what balancing bought
#   make test    the test suite
#   make lint    ruff check . (installs only ruff, no build; .ci/run runs it first)
# Also: make demo (one weighted reduction, checked and timed), make plan (the planner on an example
# mixed cluster), make bench (CPU benchmarks and their table), make info, make clean.
#
# TORCH picks the torch build, e.g. make test TORCH=torch==2.13.0 (CPU-only wheel).
# WORKERS: the test processes of make test (pytest-xdist; 2 suits a 2-core machine, as the
# distributed tests start 2-4 ranks each; WORKERS=0 runs in this process).
# HETCOMM_CUDA=1 makes the build fail rather than fall back to CPU-only (see setup.py).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
WORKERS ?= 2
# The same pin as the `test` extra in pyproject.toml.
RUFF ?= ruff==0.17.6
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetcomm-installed
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml

.PHONY: train demo plan test lint bench info clean

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)" ninja numpy
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,hf,lightning]"
	touch $@

train: $(STAMP)
	$(VENV)/bin/hetcomm train

demo: $(STAMP)
	$(VENV)/bin/hetcomm demo

plan: $(STAMP)
	$(VENV)/bin/hetcomm plan --cluster "2x1080ti,1xv100,4xt4" --net 10gbe --model gpt2-124m --global-batch 512 --seq 1024

test: $(STAMP)
	$(PY) -m pytest -n $(WORKERS) --dist loadgroup tests

lint:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(VENV)/bin/ruff || $(PY) -m pip install --quiet "$(RUFF)"
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	mkdir -p .benchmarks
	$(PY) -m pytest benchmarks/bench_ops_cpu.py --benchmark-json=.benchmarks/ops_cpu.json
	$(PY) benchmarks/report.py .benchmarks/ops_cpu.json

info: $(STAMP)
	$(VENV)/bin/hetcomm info

clean:
	rm -rf build hetcomm/_C*.so .benchmarks
