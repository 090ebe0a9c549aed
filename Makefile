# make install | install-dev | run | test | test-unit | test-app | test-e2e | test-postgres | test-real | coverage | demo | lint | bench | soak | image-smoke
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install install-dev run test test-unit test-app test-e2e test-postgres test-real coverage demo lint bench soak image-smoke clean

# Runtime dependencies only (make run, make demo); the dev extra adds litellm and the test and
# lint tools (every test target, coverage, lint, bench, soak).
install: $(STAMP)
install-dev: $(DEV_STAMP)

# Packages are installed with uv (from PyPI, into the venv; about 5x faster than pip for the
# dev extra), and with pip where uv cannot be had or fails.
PIP_INSTALL = { $(PY) -m uv --version >/dev/null 2>&1 && $(PY) -m uv pip install -q --python $(PY) $(1); } \
	|| $(PY) -m pip install -q $(1)

$(VENV)/bin/python:
	@$(PYTHON) -m venv $(VENV) || { echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip uv || $(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(call PIP_INSTALL,-e .)
	@touch $(STAMP)

$(DEV_STAMP): pyproject.toml | $(VENV)/bin/python
	$(call PIP_INSTALL,-e '.[dev]')
	@touch $(STAMP) $(DEV_STAMP)

run: install
	$(VENV)/bin/gateway serve $(ARGS)

# The tiers, one folder of tests/ each:
#   unit      pure code, the upstream seam over loopback HTTP, and the store contract on every
#             backend (memory, JSONL, PostgreSQL: its throwaway cluster starts on first use)
#   app       the whole app in-process over the store and provider twins
#   e2e       `gateway` processes: the official SDK, the CLI, the inspector, reliability
#   postgres  PostgreSQL-only behaviour, replicas, export/import
#   realmodel llama.cpp's server with a real model (about 4 min on one core: ~120 turns)
test-unit: install-dev
	$(PY) -m pytest -q -p no:cacheprovider tests/unit
test-app: install-dev
	$(PY) -m pytest -q -p no:cacheprovider tests/app
test-e2e: install-dev
	$(PY) -m pytest -q -p no:cacheprovider tests/e2e
test-postgres: install-dev
	$(PY) -m pytest -q -p no:cacheprovider tests/postgres
test-real: install-dev
	$(PY) -m pytest -q -p no:cacheprovider tests/realmodel

# Every tier: the real-model tier (one core, mostly the model) in a pytest process of its own,
# side by side with the others, which three xdist workers share file by file (a file's
# module-scoped gateway or cluster is started once). TEST_WORKERS=0 runs them in one process.
# The long files (processes, the PostgreSQL cluster) are handed out first, the many short ones
# last, so no worker is left with a long file at the end.
TEST_WORKERS ?= 3
# Bytecode is cached even where the environment says not to: every gateway subprocess and xdist
# worker would otherwise compile gateway/ and re-run pytest's assertion rewriting from source.
test test-unit test-app test-e2e test-postgres test-real coverage: export PYTHONDONTWRITEBYTECODE =
test: install-dev
	@tmp=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/base" tests/realmodel >"$$tmp/real.log" 2>&1 & real=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests/postgres tests/e2e tests/app tests/unit; rest=$$?; \
	wait $$real; realrc=$$?; echo "--- tests/realmodel:"; cat "$$tmp/real.log"; rm -rf "$$tmp"; \
	exit $$(( rest || realrc ))

# Line coverage of gateway/ over the whole suite, gateway subprocesses included (they are
# started with COVERAGE_PROCESS_START set, and a .pth file starts coverage in each of them).
coverage: install-dev
	@rm -rf var/coverage; mkdir -p var/coverage; \
	pth=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gateway-coverage.pth; \
	echo 'import os, coverage; os.environ.get("COVERAGE_PROCESS_START") and coverage.process_startup()' >"$$pth"; \
	export COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml GATEWAY_COVERAGE_DIR=$(CURDIR)/var/coverage; tmp=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/base" tests/realmodel >"$$tmp/real.log" 2>&1 & real=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider tests/unit tests/app tests/e2e tests/postgres; rest=$$?; \
	wait $$real; realrc=$$?; tail -1 "$$tmp/real.log"; rm -rf "$$tmp" "$$pth"; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report --format=markdown >var/coverage/report.md; \
	$(PY) -m coverage report | tail -1; exit $$(( rest || realrc ))

demo: install
	$(VENV)/bin/gateway demo

bench: install-dev
	$(PY) -m bench.run

# The long reliability runs (not in CI): 64 x 50 concurrent turns, CRASH_ROUNDS kill -9 rounds,
# SOAK_SECONDS of mixed load with faults and cancels (figures in var/soak/latest.json).
CRASH_ROUNDS ?= 1000
SOAK_SECONDS ?= 1800
soak: install-dev
	SOAK=1 CRASH_ROUNDS=$(CRASH_ROUNDS) SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m pytest -q -s tests/e2e/reliability

lint: install-dev
	$(VENV)/bin/ruff check gateway tests bench
	$(VENV)/bin/mypy gateway

# Build the image and run it (podman), then compose.yaml with PostgreSQL: slow (3-5 min), so
# neither make test nor CI runs it. See "Containers" in docs/deployment.md.
image-smoke:
	scripts/image-smoke

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
