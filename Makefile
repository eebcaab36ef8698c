# The README's two commands: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 installs quickly on the development and CI machines (a local CPU build); on a machine
# with a GPU and network, the same pin brings PyPI's CUDA build. Override with `make TORCH_SPEC=... test`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint typecheck pytest gpu-test gpu-demo gpu-lane clean

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

# One device-lane session in a single call (machine start-up is paid once): the GPU tests (TESTS: a part of the
# suite, such as tests/graphs tests/generation; the whole suite outlasts one call), the quick
# demo, then each benchmark in CASES and each profiler in TOOLS (`benchmarks/tools/README.md`). Logs and results
# go to the folder OUT, packed at the end into OUT.tgz (the device lane returns a few files only); record what a
# session found in benchmarks/results/RUNLOG.md:
# `make gpu-lane OUT=$$OUT/lane CASES="generation graphs-memory" TOOLS=profile_generation`.
# Each step has its own time limit, so one that hangs cannot take the others' time. The tests are interrupted
# (pytest alone, not the compile workers it started, so that it still prints which failed; killed 30 s later if it
# does not stop) and list every test's outcome as it runs, so a run that dies still names its failures.
# TEST_WORKERS > 0 runs the tests in that many pytest-xdist processes (installed on the device): a cold Triton cache
# makes the generation kernel tests compile about a thousand variants, which then compile in parallel.
OUT ?= gpu-lane-out
TESTS ?= tests
TEST_WORKERS ?= 0
CASES ?=
TOOLS ?=
gpu-lane:
	mkdir -p $(OUT)/results
	-PYTHONPATH=src:. timeout --foreground -s INT -k 30 540 $(PYTHON) -m pytest -m gpu -v -rf --durations=25 -p no:cacheprovider $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS)) $(TESTS) > $(OUT)/gpu-tests.txt 2>&1; tail -3 $(OUT)/gpu-tests.txt
	-PYTHONPATH=src timeout 180 $(PYTHON) -m tendril.cli demo --quick > $(OUT)/demo.txt 2>&1; tail -3 $(OUT)/demo.txt
	-for case in $(CASES); do PYTHONPATH=src:. timeout 420 $(PYTHON) -m benchmarks run $$case --out $(OUT)/results > $(OUT)/$$case.txt 2>&1; tail -3 $(OUT)/$$case.txt; done
	-for tool in $(TOOLS); do PYTHONPATH=src:. timeout 420 $(PYTHON) -m benchmarks.tools.$$tool --out $(OUT)/results > $(OUT)/$$tool.txt 2>&1; tail -3 $(OUT)/$$tool.txt; done
	tar czf $(OUT).tgz -C $(OUT) . && rm -rf $(OUT)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
