# The two commands of the README: `make demo` and `make test`. Both bootstrap first.
VENV ?= /opt/vfab-venv
PY := $(VENV)/bin/python

# `make demo` is the elastic-KVS demo; `make demo-echo` the first (echo) demo.
.PHONY: bootstrap demo demo-echo demo-helpers demo-sdhcp test unit integration bench bench-smoke lint helper report

bootstrap:
	@VFAB_VENV=$(VENV) bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m vfab.testbed.kvs_demo

demo-echo: bootstrap
	$(PY) -m vfab.testbed.demo

# PostMan helpers in front of an unmodified memcached (services/memcached-helper/demo.py).
demo-helpers: bootstrap
	$(MAKE) -C services/memcached-helper/dpdk helper
	$(PY) -m vfab.services.memcached_helper.demo

# sdhcp: 245 udhcpc + dhclient + dhcpcd clients in a burst, a split by the balancer, a kill -9 (services/sdhcp/demo.py).
demo-sdhcp: bootstrap
	$(PY) -m vfab.services.sdhcp.demo

test: bootstrap
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests/unit tests/integration
	$(PY) bench/run_all.py --smoke
	$(PY) bench/report.py

unit: bootstrap
	$(PY) -m pytest -q tests/unit

integration: bootstrap
	$(PY) -m pytest -q tests/integration

bench: bootstrap
	$(PY) bench/run_all.py

# The latest results in bench/results as one HTML page with plots: bench/results/report/index.html.
report: bootstrap
	$(PY) bench/report.py

lint: bootstrap
	$(PY) -m ruff check .

# The PostMan helper's DPDK program (meson + ninja): services/memcached-helper/dpdk/build/meson/mc-helper.
# The tests build their own copy; this is for running it by hand (see services/memcached-helper/README.md).
helper: bootstrap
	$(MAKE) -C services/memcached-helper/dpdk helper
