# make run: set up .venv and run the main job; make test: the test suite (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup lock run test test-all lint bench bench-async bench-server bench-communication bench-data bench-reproduce browser clean

setup: $(VENV)/.installed

# torch is pinned to 2.13.0 in pyproject.toml (see the comment there about CPU and CUDA wheels);
# constraints.txt pins every other package to the version the test suite passed with.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $@

# Newer versions: install the project afresh in a scratch venv, as far as pyproject.toml allows,
# and write what it got to constraints.txt (torch without its +cpu/+cuXXX label, so either build
# matches; a package no longer needed drops out); then `make test` (which reinstalls .venv).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	{ grep '^#' constraints.txt; .venv-lock/bin/pip freeze --exclude-editable | grep -iv '^diloco==' | \
	  sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf .venv-lock

run: setup
	$(VENV)/bin/diloco train

# The status page's test drives a real headless browser: Debian's chromium, installed here when it
# is missing and apt-get can (root); elsewhere that one test is skipped (CI requires it: .ci/run).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  (command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	   apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "note: no chromium (apt-get install chromium); the status page's browser test will be skipped"

# pytest exits 5 when it collects no test: say so plainly instead of failing with make's code.
# Two pytest processes, each taking whole test files: on 2 cores the suite takes ~7 minutes instead
# of ~10, since most tests wait on the processes they start. TEST_PROCS=0: one process.
TEST_PROCS ?= 2
test: setup browser
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

test-all: setup
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadfile -m ''

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# About 10 minutes; bench-async (the asynchronous methods against sync, 3 seeds) about 40.
bench: setup
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/sim_parallel.py
	$(PY) benchmarks/collective.py

bench-async: setup
	$(PY) benchmarks/async_vs_sync.py

# The parameter server: ~1 minute of transport, ~2 of load with faults, ~10 of sync against async.
bench-server: setup
	$(PY) benchmarks/server_transport.py
	$(PY) benchmarks/server_load.py
	$(PY) benchmarks/server_async_vs_sync.py

# Communication: a real shaped link (root; ~7 minutes) and bytes to quality (~130 runs, ~7 h on 2 cores).
bench-communication: setup
	$(PY) benchmarks/wan.py
	$(PY) benchmarks/bytes_to_loss.py

# Your own text (--data): tokenisation, the cache, training speed and memory on 100 MB (~6 minutes).
bench-data: setup
	$(PY) benchmarks/data_pipeline.py

# The DiLoCo paper's claims (issue 13), every part over 3 seeds: hours on 2 cores (see the script's
# docstring for each part); cached runs are reused, so `--part dp` etc. can run one at a time.
bench-reproduce: setup
	$(PY) benchmarks/reproduce_diloco.py

clean:
	rm -rf $(VENV) runs .pytest_cache
