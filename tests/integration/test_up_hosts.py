"""``vfab up --hosts 3`` brings up 3 emulated hosts with a 3-member etcd cluster (one member per host) and node
agents joined, says how to reach it, and ``vfab down`` leaves nothing behind (issue 45)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vfab.testbed import leftovers
from vfab.testbed import lock
from vfab.testbed.lock import acquire_lock, release_lock
from vfab.testbed.procs import wait_for
from vfab.vid.state.sched import proc_stat


def vfab(env: dict, *args: str, timeout: float = 180, fds: tuple = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfab.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, pass_fds=fds)


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def up_and_down(tmp_path) -> None:
    env = dict(os.environ, VFAB_STATE_DIR=str(tmp_path / "state"), **{lock.LOCK_FD_ENV: str(lock.lock_fd())})
    env.pop("VFAB_ETCD", None)
    res = vfab(env, "up", "--hosts", "3", "--timeout", "150", fds=(lock.lock_fd(),))
    state_file = tmp_path / "state" / "up.json"
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        out = res.stdout
        print(out)
        assert "3 hosts (host1, host2, host3), etcd cluster of 3 (members on host1, host2, host3), node agents " \
               "joined" in out, out
        assert "vfab exec host1 -- vfab node list" in out and "vfn1p1 (host1)" in out and "vfab down" in out, out
        state = json.loads(state_file.read_text())
        assert state["kind"] == "hosts" and len(state["etcd_members"]) == 3
        # this machine reaches the cluster (the relays are the default while the fabric is up)
        res = vfab(env, "node", "list", "--json")
        assert res.returncode == 0, res.stderr
        found = json.loads(res.stdout)
        assert set(found) == {"host1", "host2", "host3"}
        assert all(len(n["peers"]) == 2 for n in found.values()), found
        res = vfab(env, "status")
        assert res.returncode == 0 and "('vfab up --hosts': 3 hosts, see 'vfab node list')" in res.stdout, res.stdout
        assert "etcd members" in res.stdout and "leader" in res.stdout, res.stdout
        res = vfab(env, "status", "--json")
        assert res.returncode == 0, res.stderr
        members = json.loads(res.stdout)["etcd"]["members"]
        assert len(members) == 3 and sum(m["leader"] for m in members) == 1 and not any(m["error"] for m in members)
        # a host's processes list its own member first, on the control network
        assert state["nodes"]["host2"]["etcd"].startswith("172.16.46.2:2379,")
        res = vfab(env, "exec", "host2", "--", sys.executable, "-m", "vfab.cli", "status", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["etcd"]["using"] == "172.16.46.2:2379"
        res = vfab(env, "exec", "vfn3p1", "--", "ip", "-o", "link", "show", "eth0")
        assert res.returncode == 0 and "02:fb:00:03:00:01" in res.stdout, res.stdout + res.stderr
        res = vfab(env, "up", "--hosts", "3")
        assert res.returncode == 1 and "a fabric is already up" in res.stderr
        pids = [state["pid"], *(m["pid"] for m in state["etcd_members"].values()),
                *(n["agent"] for n in state["nodes"].values())]
    finally:
        down = vfab(env, "down", timeout=120)
    assert down.returncode == 0 and "fabric down" in down.stdout, down.stdout + down.stderr
    assert not state_file.exists()
    for pid in pids:
        wait_for(lambda pid=pid: not alive(pid), 10, f"pid {pid} to be gone")
    # still under the lock: no other testbed builds its namespaces while we look
    left = [ns for ns in leftovers.list_netns() if ns.startswith(("vfn", "vfu"))]
    assert left == [], f"namespaces left: {left}"
    assert not [ln for ln in leftovers.list_links() if ln.startswith(("vfn", "vfu", "vfc"))]
    records = os.listdir(leftovers.STATE_DIR) if os.path.isdir(leftovers.STATE_DIR) else []
    mine = [f for f in records if state["workdir"] in open(os.path.join(leftovers.STATE_DIR, f)).read()]
    assert mine == [], f"run records left: {mine}"
    assert not os.path.exists(os.path.join(state["workdir"], "etcd")), "etcd's data left"


def test_up_hosts_3_then_down_leaves_nothing(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")
    acquire_lock()   # held from 'up' to the check after 'down' (handed down to the fabric's process)
    try:
        up_and_down(tmp_path)
    finally:
        release_lock()
