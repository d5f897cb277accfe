# `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: demo test lint bench clean

$(BIN)/streampack: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,cuda]'
	touch $@

demo: $(BIN)/streampack
	$(BIN)/streampack demo

test: $(BIN)/streampack
	$(BIN)/ruff check streampack workers tests benchmarks
	$(BIN)/python -m pytest -q

bench: $(BIN)/streampack
	$(BIN)/python benchmarks/pack.py

clean:
	rm -rf $(VENV) .numba_cache .pytest_cache .hypothesis
