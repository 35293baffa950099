# Two commands do all the set-up on a fresh machine:
#   make book   -> builds the HTML book into _build/html (makes .venv and installs what it needs)
#   make test   -> lint, types, unit + multiprocess + fault-injection tests, nbval on every notebook
#   make test-fast -> lint, types and the library's tests without the notebooks or the slow runs
#   make chapter N=06 -> one chapter, re-run and compared as CI does
#   make lab    -> JupyterLab on a working copy of notebooks/ (lab/), localhost, .venv kernel
#   make dist   -> a wheel of refimpl in dist/, to pip install into an environment you have
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LAB_STAMP := $(VENV)/.lab-installed
LAB_PORT ?= 8888
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=300
# Test workers (pytest-xdist), one file per work unit: a notebook's cells run in order in one
# kernel, and a test file runs whole on one worker. TEST_WORKERS=0 runs everything in order.
# Three: two take any file, longest first (tests/conftest.py; --no-loadscope-reorder keeps
# that order), so no worker is left with a long file at the end; the third takes the files
# that mostly wait (timeouts, stalls, restarts) and use little CPU (conftest's _LIGHT), filling
# the time the cores would sit idle, then short test files (never a chapter) of the tail.
# Never three CPU-heavy files on the two cores: then the chapters' measured shapes (chapter
# 1's all-reduce against its memcpy floor) and the elastic runs' heartbeats start to fail.
TEST_WORKERS ?= 3
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
export PYTHONHASHSEED := 0
# Notebooks show figures through the inline backend; an inherited MPLBACKEND=Agg hides them.
unexport MPLBACKEND

.PHONY: venv test test-fast lint book browser-test lab notebooks clean chapter dist

# uv installs the same pins as pip does, about twice as fast from an empty cache (parallel
# downloads and bytecode compilation: these machines set PYTHONDONTWRITEBYTECODE, so what is not
# compiled at install is compiled again by every process that imports it). uv reads no pip
# configuration: pip's find-links and index settings are passed to it, with pip's rule for
# several indexes (the best match among all). If uv fails, pip installs instead;
# INSTALLER=pip uses pip alone.
INSTALLER ?= uv
UV_VERSION := 0.13.9
pip_setting = $(shell $(PYTHON) -m pip config get global.$(1) 2>/dev/null)
# Read pip's settings once, on first use (not when make starts, nor again for each install).
UV_SOURCES = $(eval UV_SOURCES := \
	$(addprefix --find-links ,$(sort $(PIP_FIND_LINKS) $(call pip_setting,find-links))) \
	$(addprefix --index-url ,$(or $(PIP_INDEX_URL),$(call pip_setting,index-url))) \
	$(addprefix --extra-index-url ,$(or $(PIP_EXTRA_INDEX_URL),$(call pip_setting,extra-index-url))))$(UV_SOURCES)
# $(call install,ARGS): uv pip install ARGS into the venv, falling back to pip install ARGS
install = $(if $(filter uv,$(INSTALLER)),$(VENV)/bin/uv pip install -q --python $(PY) \
	--compile-bytecode --index-strategy unsafe-best-match $(UV_SOURCES) $(1) \
	|| { echo "uv failed: installing with pip"; $(PY) -m pip install -q $(1); }, \
	$(PY) -m pip install -q $(1))

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(filter uv,$(INSTALLER)),$(PY) -m pip install -q uv==$(UV_VERSION),$(PY) -m pip install -q --upgrade pip)
	$(call install,-r requirements.txt)
	$(call install,--no-deps -e .)
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

$(LAB_STAMP): $(STAMP) requirements-lab.txt
	$(call install,-r requirements-lab.txt)
	touch $(LAB_STAMP)

# Open the notebooks interactively: JupyterLab bound to localhost only, kernel = this .venv.
# It serves a working copy (LAB_DIR, ignored by git; tools/lab_workdir.py makes it), so that
# running and autosaving a chapter never rewrites the committed notebooks. It prints the URL
# (with its login token) to open; Ctrl-C stops it. LAB_ARGS passes more options to jupyter.
LAB_DIR ?= lab
lab: $(LAB_STAMP)
	$(PY) tools/lab_workdir.py $(LAB_DIR)
	$(VENV)/bin/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir=$(abspath $(LAB_DIR)) $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True) \
		$(LAB_ARGS)

# A wheel of refimpl (no .venv needed: pip builds it in an isolated environment of its own),
# for `pip install dist/refimpl-*.whl` into the environment a trainer already runs in.
dist:
	$(PYTHON) -m pip wheel --no-deps --wheel-dir dist .

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools notebooks
	$(VENV)/bin/ruff format --check src tests tools notebooks
	$(VENV)/bin/mypy

# Lint and types run beside the tests (mypy keeps one core busy for a few seconds while the
# first files start their ranks); their output is printed, and a failure fails the target,
# once the tests end. `make lint` alone gives the quick answer.
test: $(STAMP)
	@lint_log=$$(mktemp); ( $(MAKE) --no-print-directory lint >"$$lint_log" 2>&1 ) & lint_pid=$$!; \
	$(PY) -m pytest notebooks tests $(NBVAL) --ignore=tests/browser $(PARALLEL) --durations=15; \
	status=$$?; wait $$lint_pid; lint_status=$$?; \
	echo "--- make lint (ruff, ruff format --check, mypy) ---"; cat "$$lint_log"; rm -f "$$lint_log"; \
	if [ $$lint_status -ne 0 ]; then echo "make test: lint or types failed (above)"; exit 1; fi; \
	exit $$status

# One chapter, checked as CI checks it (nbval re-runs it and compares every output): make chapter N=06
chapter: $(STAMP)
	@test -n "$(N)" || { echo "usage: make chapter N=06 (the chapter's number)"; exit 2; }
	$(PY) -m pytest notebooks/$(N)_*.ipynb $(NBVAL) -p no:cacheprovider -q

# The inner loop while changing src/refimpl: everything but the notebooks, the browser and the
# tests marked slow (whole torchrun jobs, benchmarks); make test runs those too.
test-fast: lint
	$(PY) -m pytest tests --ignore=tests/browser -m "not slow" $(PARALLEL) --durations=10

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "Book built: open file://$(CURDIR)/_build/html/index.html"

# Needs Debian's chromium (apt-get install -y chromium); .ci/run installs it. The built book's
# pages, then the notebooks run live in JupyterLab (tests/browser/test_lab_in_chromium.py).
browser-test: $(LAB_STAMP)
	$(PY) -m pytest tests/browser -p no:cacheprovider

# Re-execute every notebook in place and normalise it (run after editing one, then commit).
notebooks: $(STAMP)
	$(PY) tools/run_notebooks.py notebooks/*.ipynb

clean:
	rm -rf _build .pytest_cache .mypy_cache .ruff_cache
