# The two commands of the README: `make demo` and `make test`. Both bootstrap first.
VENV ?= /opt/vfab-venv
PY := $(VENV)/bin/python

.PHONY: bootstrap demo test unit integration bench bench-smoke lint

bootstrap:
	@VFAB_VENV=$(VENV) bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m vfab.testbed.demo

test: bootstrap
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests/unit tests/integration
	$(PY) bench/run_all.py --smoke

unit: bootstrap
	$(PY) -m pytest -q tests/unit

integration: bootstrap
	$(PY) -m pytest -q tests/integration

bench: bootstrap
	$(PY) bench/run_all.py

lint: bootstrap
	$(PY) -m ruff check .
