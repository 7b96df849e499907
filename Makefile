# Two commands for a fresh Linux machine with Python 3.11 (or newer: PYTHON=python3.12):
#   make run    installs Gapless into .venv and opens the app on the default model
#   make test   installs Gapless with its test tools into .venv and runs the test suite (not the heavy test)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first, from TORCH_INDEX where given (e.g. https://download.pytorch.org/whl/cpu for the CPU
# build, .../whl/cu130 for a CUDA one); without it pip's own index decides (from PyPI on Linux: the CUDA build).
# Both apply when .venv is made (make clean first to change the build).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: run test test-heavy lint install install-test bench bundle clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.torch: $(VENV)/.created
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	touch $@

install: $(VENV)/.torch
	$(PY) -m pip install --quiet -e .

install-test: $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[test]"

run: install
	$(PY) -m app.qt_deps
	$(VENV)/bin/gapless gui --model default

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -m "not heavy"

test-heavy: install-test
	$(PY) -m pytest -q -m heavy

bench: install
	$(VENV)/bin/gapless bench --model default --json bench.json  # docs/bench-cpu.json is the committed run docs/benchmarks.md quotes

bundle: $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[package]"
	PYTHON="$(abspath $(PY))" bash packaging/build.sh

clean:
	rm -rf $(VENV) build dist packaging/out
