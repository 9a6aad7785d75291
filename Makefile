# The two set-up commands: `make demo` and `make test`. Each creates .venv on a
# fresh clone and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[server,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pipelines.examples.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check pipelines tests benchmarks
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python benchmarks/ensemble_vs_bls.py --out bench-results

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
