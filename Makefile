# Two commands for a fresh Linux machine with Python 3.11:
#   make run    installs Gapless into .venv and opens the app on the default model
#   make test   installs Gapless with its test tools into .venv and runs the whole test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first; a plain `torch` requirement would pull a CUDA build of several GB.
# On a workstation with an NVIDIA GPU, use TORCH_SPEC="torch==2.13.0" with PyTorch's CUDA index instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test test-heavy lint install install-test bench bundle clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.torch: $(VENV)/.created
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
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
	$(VENV)/bin/gapless bench --model default --json docs/bench-cpu.json

bundle: $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[package]"
	PYTHON=$(abspath $(PY)) bash packaging/build.sh

clean:
	rm -rf $(VENV) build dist packaging/out
