"""``make demo-sdhcp`` still runs: its ``--smoke`` version (20 udhcpc, 1 dhclient, 1 dhcpcd) end to end.

The demo builds its own fabric (so this file uses no ``testbed`` fixture) and checks, from the clients'
side, that every client leased, no address was held by two clients and the leases survived a split by
the balancer and a kill -9 of a mirrored shard; it exits 1 if any check failed.  Here its output must
show each step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TIMEOUT = 400   # s: the demo itself takes about a minute, plus any wait for another run's testbed lock


def test_demo_smoke_runs_every_step_and_passes_its_checks():
    if os.geteuid() != 0:
        pytest.fail("the demo needs root (network namespaces, Open vSwitch)")
    res = subprocess.run([sys.executable, "-m", "vfab.services.sdhcp.demo", "--smoke"], capture_output=True,
                         text=True, timeout=TIMEOUT)
    out = res.stdout + res.stderr
    print(out[:600], "\n...\n", out[-5000:])   # the head says how long the fabric took (another run's lock)
    assert res.returncode == 0, out[-6000:]
    for step in ("1. [", "2. [", "3. [", "4. [", "5. [", "[ok] the balancer split the hot shard by itself",
                 "renewed at m after the kill", "[ok] every client holds a lease: 22/22",
                 "[ok] no address was ever held by two clients", "[ok] leases survived", "offers/acks/naks per s",
                 "balancer decisions: dhd", "[ok] the balancer merged the idle shards by itself",
                 "holds every client's lease record after the merge", "all checks passed"):
        assert step in out, step
    assert "FAILED" not in out and "Traceback" not in out
