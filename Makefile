# make install | run | test | demo | lint | bench | soak
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test coverage demo lint bench soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) || { echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

run: install
	$(VENV)/bin/gateway serve

# Two pytest processes side by side: the real-model tier (llama.cpp on one core, 3-5 min) and
# everything else (unit, process, reliability and PostgreSQL tests) on the other.
test: install
	@tmp=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/base" tests/realmodel >"$$tmp/real.log" 2>&1 & real=$$!; \
	$(PY) -m pytest -q --ignore=tests/realmodel; rest=$$?; \
	wait $$real; realrc=$$?; echo "--- tests/realmodel:"; cat "$$tmp/real.log"; rm -rf "$$tmp"; \
	exit $$(( rest || realrc ))

# Line coverage of gateway/ over the whole suite, gateway subprocesses included (they are
# started with COVERAGE_PROCESS_START set, and a .pth file starts coverage in each of them).
coverage: install
	@rm -rf var/coverage; mkdir -p var/coverage; \
	pth=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gateway-coverage.pth; \
	echo 'import os, coverage; os.environ.get("COVERAGE_PROCESS_START") and coverage.process_startup()' >"$$pth"; \
	export COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml GATEWAY_COVERAGE_DIR=$(CURDIR)/var/coverage; tmp=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/base" tests/realmodel >"$$tmp/real.log" 2>&1 & real=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/realmodel; rest=$$?; \
	wait $$real; realrc=$$?; tail -1 "$$tmp/real.log"; rm -rf "$$tmp" "$$pth"; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report --format=markdown >var/coverage/report.md; \
	$(PY) -m coverage report | tail -1; exit $$(( rest || realrc ))

demo: install
	$(VENV)/bin/gateway demo

bench: install
	$(PY) bench/run.py

# The long reliability runs (not in CI): 64 x 50 concurrent turns, CRASH_ROUNDS kill -9 rounds,
# SOAK_SECONDS of mixed load with faults and cancels (figures in var/soak/latest.json).
CRASH_ROUNDS ?= 1000
SOAK_SECONDS ?= 1800
soak: install
	SOAK=1 CRASH_ROUNDS=$(CRASH_ROUNDS) SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m pytest -q -s tests/reliability

lint: install
	$(VENV)/bin/ruff check gateway tests
	$(VENV)/bin/mypy gateway

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
