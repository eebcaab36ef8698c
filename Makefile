# The README's two commands: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 installs quickly on the development and CI machines (a local CPU build); on a machine
# with a GPU and network, the same pin brings PyPI's CUDA build. Override with `make TORCH_SPEC=... test`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint typecheck pytest gpu-test gpu-demo clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/tendril demo

test: lint typecheck pytest

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks

typecheck: $(BIN)/.installed
	$(BIN)/mypy src/tendril

pytest: $(BIN)/.installed
	$(BIN)/python -m pytest -q

# On a CUDA machine with no network (the H200 device lane): run from the source tree with the
# machine's own python3 and packages; nothing is installed.
gpu-test:
	PYTHONPATH=src $(PYTHON) -m pytest -m gpu -q

gpu-demo:
	PYTHONPATH=src $(PYTHON) -m tendril.cli demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
