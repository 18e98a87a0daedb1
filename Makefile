# The two commands of the README: `make demo` and `make test`. Both bootstrap first.
VENV ?= /opt/vfab-venv
PY := $(VENV)/bin/python

# `make demo` is the elastic-KVS demo; `make demo-echo` the first (echo) demo.
.PHONY: bootstrap demo demo-echo test unit integration bench bench-smoke lint helper

bootstrap:
	@VFAB_VENV=$(VENV) bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m vfab.testbed.kvs_demo

demo-echo: bootstrap
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

# The PostMan helper's DPDK program (meson + ninja): services/memcached-helper/dpdk/build/meson/mc-helper.
# The tests build their own copy; this is for running it by hand (see services/memcached-helper/README.md).
helper: bootstrap
	$(MAKE) -C services/memcached-helper/dpdk helper
