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

# The OCR example: a CRNN learns to read synthetic text lines, 2 ranks on this machine's
# CPUs (Lightning + RingStrategy, bucketed variable-width batches), about 3 minutes.
demo: $(STAMP)
	$(BIN)/ringrun -np 2 $(BIN)/python examples/ocr/train_lightning.py --timeline ocr-timeline.json

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples

clean:
	rm -rf $(VENV) build src/*.egg-info
