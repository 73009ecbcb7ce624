# The two commands of README.md: `make run` and `make test`. Both create the virtual
# environment on first use. CPU-only installs pin torch to the CPU wheel (an unpinned
# torch pulls several GB of CUDA wheels) and numpy<2.3 (Triton 3.6's interpreter fails
# with numpy 2.4+).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_PINS := torch==2.13.0 triton==3.6.0 "numpy<2.3"

.PHONY: run test lint gpu-test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_PINS) -e ".[dev]"
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/fmha run --demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --durations=15

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests

# On a CUDA machine with torch and triton installed (no venv): the GPU test suite.
gpu-test:
	PYTHONPATH=src python3 -m pytest -q -m gpu -x

clean:
	rm -rf $(VENV)
