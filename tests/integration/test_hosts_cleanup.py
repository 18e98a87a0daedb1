"""The multi-host testbed cleans up after itself: on a failed start, and after a run killed with SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vfab.testbed import leftovers, lock
from vfab.testbed.hosts import HostsTestbed


@pytest.fixture(autouse=True)
def root():
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")


def ours() -> list[str]:
    return [ns for ns in leftovers.list_netns() if ns.startswith("vfn")]


def test_a_failed_start_leaves_nothing(tmp_path):
    """A testbed whose start fails part-way removes every namespace and process it made, and the lock."""
    bed = HostsTestbed(2, workdir=str(tmp_path), agents=False)
    made: list[int] = []

    def boom(h):
        made.extend(p.pid for p in bed.sup.procs)
        raise RuntimeError("injected failure while building host2")

    real = bed._host
    bed._host = lambda h: real(h) if h.n == 1 else boom(h)
    with pytest.raises(RuntimeError, match="injected failure"):
        bed.start()
    assert made, "host1's daemons and etcd should have run"
    for pid in made:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert ours() == []
    assert lock._lock_depth == 0


KEEPER = """
import sys, time
from vfab.testbed.hosts import HostsTestbed
bed = HostsTestbed(2, workdir=sys.argv[1]).start()
print("up", flush=True)
time.sleep(600)
"""


def test_a_killed_run_is_swept_by_the_next(tmp_path):
    """SIGKILL a run holding 2 hosts with their agents: the next testbed removes its namespaces and processes."""
    proc = subprocess.Popen([sys.executable, "-c", KEEPER, str(tmp_path / "dead")], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up", "the first run did not come up"
        record = next(os.path.join(leftovers.STATE_DIR, f) for f in os.listdir(leftovers.STATE_DIR)
                      if f.startswith(f"{proc.pid}-") and f.endswith(".json"))
        with open(record) as fh:
            left_procs = [p["pid"] for p in json.load(fh)["procs"]]
        assert len(left_procs) >= 7   # etcd, 2 x (ovsdb-server, ovs-vswitchd, agent)
    finally:
        proc.kill()
        proc.wait()
    assert set(ours()) >= {"vfn1", "vfn2", "vfnu"}
    bed = HostsTestbed(1, workdir=str(tmp_path / "next"), agents=False).start()
    try:
        assert ours() == ["vfn1", "vfnu"] or sorted(ours()) == ["vfn1", "vfnu"]
        assert not os.path.exists(record)
        alive = [pid for pid in left_procs if os.path.exists(f"/proc/{pid}")
                 and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
        assert alive == [], f"processes of the killed run still alive: {alive}"
    finally:
        bed.stop()
    assert ours() == []
