# make install | run | test | demo | lint | bench
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test demo lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) || { echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

run: install
	$(VENV)/bin/gateway serve

test: install
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/gateway demo

bench: install
	$(PY) bench/run.py

lint: install
	$(VENV)/bin/ruff check gateway tests
	$(VENV)/bin/mypy gateway

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
