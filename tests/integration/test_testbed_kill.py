"""A killed testbed, on real OVS + etcd + os-ken + Mininet (issue 11, part 5).

- SIGTERM and SIGHUP unwind like SIGINT: every process, bridge and veth the run
  made is gone when it exits, and the next testbed starts clean.
- SIGKILL leaves things behind; the next testbed removes them (only what the
  dead run recorded), says so line by line, and starts.
- The record of a live run is not touched by a new testbed.

The testbed under test runs in a subprocess (tests/integration/hold_testbed.py).
Checks are made holding the machine's testbed lock, so no other testbed can
create the same names meanwhile.  This file's own resources are named vfk*.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from vfab.fabric import ovs
from vfab.testbed import leftovers
from vfab.testbed import fabric
from vfab.testbed.fabric import LOCK_WAIT, acquire_lock, release_lock
from vfab.vid.state.sched import proc_stat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPO = "line,2,2"   # two bridges, a trunk veth between them, four hosts


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.fail("these tests need root (network namespaces, Open vSwitch)")


def alive(pid: int) -> bool:
    """A process with this PID exists and is not a zombie."""
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def bridges() -> list[str]:
    return leftovers.list_bridges() or []


def their_links(state: dict) -> list[str]:
    """Root-namespace links named after the held testbed's nodes (Mininet: NODE-ethN; bridge ports)."""
    pat = re.compile(r"^(%s)(-eth\d+)?$" % "|".join(map(re.escape, state["nodes"])))
    return [n for n in leftovers.list_links() if pat.match(n)]


def their_pids(state: dict) -> dict[str, int]:
    return {"etcd": state["etcd"], "controller": state["controller"], "server": state["server"],
            **{f"shell {k}": v for k, v in state["shells"].items()}}


def default_signals() -> None:
    """In the child: SIGINT, SIGHUP and SIGTERM at their defaults, as from an operator's shell (a run under
    nohup, or a background job of a script, inherits SIGHUP or SIGINT ignored, which the testbed leaves alone
    by design)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def hold(tmp_path) -> tuple[subprocess.Popen, dict, str]:
    """Start a testbed in a subprocess; wait until it is up; (process, its report, its log path)."""
    ready, logpath = tmp_path / "ready.json", str(tmp_path / "hold.log")
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.hold_testbed", "--topo", TOPO,
                             "--ready", str(ready), "--workdir", str(tmp_path / "held")], cwd=REPO,
                            stdout=open(logpath, "wb"), stderr=subprocess.STDOUT, preexec_fn=default_signals)
    deadline = time.monotonic() + LOCK_WAIT + 120  # it may first wait for another testbed to finish
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"the held testbed did not come up (exit {proc.returncode}):\n"
                        + open(logpath).read()[-3000:])
        time.sleep(0.2)
    state = json.loads(ready.read_text())
    # What the run made is really there (else the checks below would prove nothing).
    assert set(state["switches"]) <= set(bridges()), bridges()
    assert any(n.startswith("vfbs1-eth") for n in their_links(state)), leftovers.list_links()
    dead = {k: p for k, p in their_pids(state).items() if not alive(p)}
    assert not dead, f"processes of the held testbed not running: {dead}"
    assert os.path.exists(state["record"])
    return proc, state, logpath


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_unwinds_the_testbed(tmp_path, caplog, sig):
    proc, state, logpath = hold(tmp_path)
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the testbed did not exit within 90 s of {sig.name}:\n{open(logpath).read()[-3000:]}")
    took = time.monotonic() - t0
    log = open(logpath).read()
    acquire_lock()
    try:
        left = {k: p for k, p in their_pids(state).items() if alive(p)}
        assert not left, f"still running after {sig.name}: {left}"
        assert not set(state["switches"]) & set(bridges()), f"bridges left: {bridges()}"
        assert not their_links(state), f"links left: {their_links(state)}"
        assert not os.path.exists(state["record"]), "the run record was not removed"
        assert f"Interrupted: {sig.name}" in log, log[-3000:]
        assert "testbed teardown: removed" not in log, f"the teardown missed something:\n{log[-3000:]}"

        caplog.set_level(logging.WARNING, logger="vfab.testbed.leftovers")
        tb = fabric.Testbed(TOPO, workdir=str(tmp_path / "next"))
        tb.start()
        try:
            assert state["record"] not in tb.swept.records
            mine = [r for r in tb.swept.removed if any(f"process {p} " in r for p in their_pids(state).values())]
            assert not mine, mine
            assert set(tb.switches) == set(state["switches"]) <= set(bridges())
        finally:
            tb.stop()
        assert not set(state["switches"]) & set(bridges())
    finally:
        release_lock()
    print(f"{sig.name}: testbed gone {took:.1f} s after the signal")


def test_sigkill_leftovers_are_removed_by_the_next_testbed(tmp_path, caplog):
    proc, state, _ = hold(tmp_path)
    proc.kill()
    proc.wait()
    acquire_lock()
    try:
        # SIGKILL leaves the run behind: this is what the next testbed has to clean up.
        assert os.path.exists(state["record"]), "nobody may have swept it yet (we hold the lock)"
        assert set(state["switches"]) <= set(bridges())
        left = {k: p for k, p in their_pids(state).items() if alive(p)}
        for k in ("etcd", "controller", "server"):
            assert k in left, f"{k} did not outlive SIGKILL of its testbed? {left}"

        caplog.set_level(logging.WARNING, logger="vfab.testbed.leftovers")
        t0 = time.monotonic()
        tb = fabric.Testbed(TOPO, workdir=str(tmp_path / "next"))   # same names: a collision if not cleaned
        tb.start()
        try:
            took = time.monotonic() - t0
            swept = tb.swept
            assert state["record"] in swept.records
            report = caplog.text
            for k, pid in left.items():
                assert not alive(pid), f"{k} (pid {pid}) survived the sweep"
                line = next((r for r in swept.removed if r.startswith(f"process {pid} ")), None)
                assert line, f"{k} (pid {pid}) not reported: {swept.removed}"
                assert line in report
            for br in state["switches"]:
                assert f"OVS bridge {br}" in swept.removed
                assert f"removed OVS bridge {br}" in report
            etcd_dir = os.path.realpath(os.path.join(state["workdir"], "etcd"))   # its data; the logs stay
            assert f"directory {etcd_dir}" in swept.removed
            assert not os.path.exists(etcd_dir) and os.path.isdir(os.path.join(state["workdir"], "logs"))
            assert not os.path.exists(state["record"])
            # The new testbed is the one up now: its own processes, its own bridges.
            assert tb.etcd.pid not in left.values() and tb.controller.pid != state["controller"]
            assert set(tb.switches) <= set(bridges())
        finally:
            tb.stop()
        assert not set(state["switches"]) & set(bridges())
        assert not their_links(state)
    finally:
        release_lock()
    print(f"SIGKILL: next testbed swept {len(swept.removed)} leftovers and was up in {took:.1f} s:\n  "
          + "\n  ".join(swept.removed))


def test_a_live_runs_record_is_not_touched(tmp_path, caplog):
    tag = uuid.uuid4().hex[:6]
    br, veth, peer, ns = f"vfk{tag}", f"vfk{tag}a", f"vfk{tag}b", f"vfk{tag}"
    owner = subprocess.Popen(["sleep", "600"])      # stands for a testbed run that is still going
    child = subprocess.Popen(["sleep", "600"])      # one of its processes
    data_dir = tmp_path / f"vfk{tag}-data"
    path = os.path.join(leftovers.STATE_DIR, f"{owner.pid}-vfk{tag}.json")
    caplog.set_level(logging.WARNING, logger="vfab.testbed.leftovers")
    acquire_lock()
    started_ovs = False
    try:
        started_ovs = ovs.ensure_running()
        os.makedirs(leftovers.STATE_DIR, exist_ok=True)
        rec = leftovers.RunRecord(path, {
            "version": 1, "boot_id": leftovers.boot_id(), "owner": leftovers.identity(owner.pid, "owner"),
            "created": "test", "procs": [leftovers.identity(child.pid, "vfk-child")], "bridges": [br],
            "nodes": [], "links": [veth], "netns": [ns], "dirs": [str(data_dir)], "ovs": None})
        rec.write()
        ovs.vsctl("add-br", br, "--", "set", "bridge", br, "datapath_type=netdev")
        subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer], check=True)
        subprocess.run(["ip", "netns", "add", ns], check=True)
        data_dir.mkdir()

        def everything_there() -> None:
            assert os.path.exists(path), "the live run's record was deleted"
            assert br in bridges()
            assert {veth, peer} <= set(leftovers.list_links())
            assert ns in leftovers.list_netns()
            assert alive(child.pid) and data_dir.is_dir()

        tb = fabric.Testbed("single,1", workdir=str(tmp_path / "tb"))
        tb.start()
        try:
            assert path in tb.swept.live and path not in tb.swept.records
            everything_there()
            assert tag not in caplog.text
        finally:
            tb.stop()
        everything_there()

        # The same record once its owner has died is cleared, item by item.
        owner.kill()
        owner.wait()
        swept = leftovers.sweep()
        assert path in swept.records
        assert not os.path.exists(path)
        child.wait(10)
        assert br not in bridges() and f"removed OVS bridge {br}" in caplog.text
        assert veth not in leftovers.list_links() and peer not in leftovers.list_links()
        assert f"removed link {veth}" in caplog.text
        assert ns not in leftovers.list_netns() and f"removed network namespace {ns}" in caplog.text
        assert not data_dir.exists() and f"removed directory {data_dir}" in caplog.text
        assert f"removed process {child.pid} (vfk-child" in caplog.text
    finally:
        for p in (owner, child):
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["ovs-vsctl", "--if-exists", "del-br", br], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for p in (path, f"{path}.tmp"):
            if os.path.exists(p):
                os.unlink(p)
        if started_ovs and not bridges():
            ovs.stop()
        release_lock()


def test_a_testbeds_own_workdir_keeps_its_logs_not_its_data(monkeypatch):
    """A testbed that made its own workdir removes the folders in it (etcd's data, stores) when it stops and
    keeps its logs and files; each run used to leave up to ~0.8 GB in /tmp."""
    monkeypatch.delenv("VFAB_KEEP_WORKDIR", raising=False)
    tb = fabric.Testbed("single,1")
    tb.start()
    try:
        data = os.path.join(tb.workdir, "data-vfk")
        os.makedirs(os.path.join(data, "deep"))
        with open(os.path.join(data, "deep", "store.db"), "wb") as fh:
            fh.write(b"x" * 4096)
        with open(os.path.join(tb.workdir, "vfk.out"), "w") as fh:
            fh.write("output")
        assert os.path.isdir(os.path.join(tb.workdir, "etcd"))
    finally:
        tb.stop()
    try:
        left = sorted(os.listdir(tb.workdir))
        assert "etcd" not in left and "data-vfk" not in left, left
        assert "logs" in left and "vfk.out" in left, left
        assert os.listdir(os.path.join(tb.workdir, "logs")), "the run's logs were removed"
    finally:
        shutil.rmtree(tb.workdir, ignore_errors=True)
