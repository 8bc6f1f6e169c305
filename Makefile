# The two set-up commands: `make train` and `make test`. Both create .venv when it is missing.
# JAX 0.12 needs Python >= 3.12: the first of these that runs and is new enough.
PYTHON ?= $(firstword $(foreach p,python3.12 python3.13 python3,$(shell $(p) -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo $(p))))
VENV := .venv
BIN := $(VENV)/bin
DEVICES ?= 8

.PHONY: train test test-all test-oldest bench clean

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "axonn_jax needs Python >= 3.12 (JAX 0.12): none found; set PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Core package (editable), re-installed when pyproject.toml changes.
$(VENV)/.core: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

# Test, data, MPI and compile extras. mpi4jax builds from source against the mpich wheel, without
# build isolation; the CUDA compile plugin is pinned to the installed jaxlib's version.
$(VENV)/.test: $(VENV)/.core
	$(BIN)/pip install --quiet -e ".[test,bench,data]"
	bash scripts/install_mpi_extra.sh $(VENV)
	bash scripts/install_compile_extra.sh $(VENV)
	touch $@

# The documentation site's tools (the docs extra); the site imports the package for its references.
$(VENV)/.docs: $(VENV)/.core
	$(BIN)/pip install --quiet -e ".[docs]"
	touch $@

train: $(VENV)/.core
	$(BIN)/axonn-jax train --config configs/default.yaml --devices $(DEVICES)

# The quick tier: every capability, each on its representative grids (13-20 minutes on a shared
# 2-core VM, whose speed varies 1.5x from run to run; the target is 15). A test that crashes its
# worker fails the run (no worker restarts, which re-ran the crash and hung); one that hangs is
# stopped by pytest-timeout (pyproject.toml).
test: $(VENV)/.test
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=25 -m "not extended" tests

# CI: also the extended tier (tests/extended.txt): every grid, schedule and process count (~70 minutes in all),
# and the documentation site built strictly (`docs`, first: a broken page fails fast).
test-all: $(VENV)/.test docs
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=25 tests
	$(MAKE) test-oldest

# The oldest JAX the package supports (pyproject.toml's lower bound: what the lent GPU machines
# hold) in a venv of its own, and the parts of the suite that lean on JAX's internals or changed
# APIs: the hand-written layer backward and its exchange stages, the zero-bubble pipeline's jaxpr
# split, and the covering cells of the dtype x memory x axis matrix.
OLDEST_JAX := 0.11.2
OLDEST := .venv-jax$(OLDEST_JAX)
$(OLDEST)/.core: pyproject.toml
	@test -n "$(PYTHON)" || { echo "axonn_jax needs Python >= 3.12: none found; set PYTHON="; exit 1; }
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --quiet --upgrade pip
	$(OLDEST)/bin/pip install --quiet -e . "jax==$(OLDEST_JAX)" "jaxlib==$(OLDEST_JAX)" \
		"pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5"
	touch $@

test-oldest: $(OLDEST)/.core
	$(OLDEST)/bin/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 -m "not extended" \
		tests/test_exchange.py tests/test_pipeline.py tests/test_mode_matrix.py

# The documentation site (docs/, mkdocs.yml) into build/site, strictly: any warning fails it.
.PHONY: docs
docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info
