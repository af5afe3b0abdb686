# The two commands: `make train` and `make test`.  Both set everything up from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zb-installed
TORCH_CPU := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: all setup train test test-slow bench lint format clean

all: test

# A GPU user's CUDA torch is kept: the venv then sees the system site-packages.
$(PY):
	@if $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		echo "[setup] CUDA torch found: creating $(VENV) with --system-site-packages"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		echo "[setup] creating $(VENV)"; \
		$(PYTHON) -m venv $(VENV); \
	fi

$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "[setup] installing $(TORCH_CPU) (CPU)"; $(PY) -m pip install -q $(TORCH_CPU); fi
	$(PY) -m pip install -q setuptools wheel "pybind11>=2.11"
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) tools/make_train.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/run_benchmarks.py --out bench/results

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf build *.egg-info $(STAMP)
	find . -name '*.so' -path './megatron/*' -delete; find . -name '*.so' -path './zb_pipeline/*' -delete
