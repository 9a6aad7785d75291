# The two set-up commands: `make demo` and `make test`. Each creates .venv on a
# fresh clone and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The suite waits on servers and subprocesses about as much as it computes: on two quiet cores
# four workers ran it in 7 min 52 s where three took 8 min 36 s. `make test` hands out whole
# files (a module's server starts once), the longest and the server files first
# (tests/conftest.py), so no worker idles at the end.
WORKERS ?= 4
# Material for MkDocs prints a notice about MkDocs 2.0 on every build; it is not about this site.
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test test-fast docs lint bench clean

# editable_mode=compat puts the checkout on sys.path, where a real package beats a folder named
# `pipelines` (no __init__.py) beside a user's script; the default finder runs after that folder wins.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[server,onnx,dev,docs]" --config-settings editable_mode=compat
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pipelines.examples.demo

# The whole suite, the real tritonserver and the strict docs build included (tests/test_docs.py).
# Tests marked solo measure the machine itself (memory bandwidth): beside the other workers
# they would measure those workers, so they run after them, alone.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not solo"
	$(BIN)/python -m pytest -q -m solo

# The tests that start no Triton server: under 2 minutes, for the edit-test loop.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "not server and not solo" --durations=10
	$(BIN)/python -m pytest -q -m "solo and not server"

# The docs site, into site/; --strict turns a broken link or a missing page into a failure.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# The type checker reads its modules from pyproject.toml ([tool.mypy]): the public API's.
lint: $(STAMP)
	$(BIN)/ruff check pipelines tests benchmarks
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/ensemble_vs_bls.py --out bench-results

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .hypothesis
