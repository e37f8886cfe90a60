# `make demo` and `make test` create or refresh .venv by themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ringplug-installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

# Refreshed whenever the project's dependencies or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[mpich,dev]' torch
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ringrun -np 2 $(BIN)/ringplug-bench allreduce --max-size 64M

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info
