"""End to end on real OVS + os-ken + etcd in Mininet: routing, cut-over, controller death, port security.

Topology line,2,3: switches vfbs1 - vfbs2; vfh1-3 on vfbs1, vfh4-6 on vfbs2.
Echo servers: s1 on vfh1 (rx=ovs), s2 on vfh4 (rx=ovs, other switch), s3 on vfh5 (rx=bpf).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import client_args, run_client, start_server
from vfab.fabric.compiler import compile_fabric
from vfab.fabric.state import FabricState
from vfab.vid import codec
from vfab.vid.registry import schema
from vfab.vid.ranges import Range

THIRD = (codec.KEY_MAX + 1) // 3
R1, R2, R3 = Range(0, THIRD - 1), Range(THIRD, 2 * THIRD - 1), Range(2 * THIRD, codec.KEY_MAX)


@pytest.fixture(scope="module")
def echo(testbed):
    testbed.registry.create_service("echo")
    servers = {
        "s1": start_server(testbed, "vfh1", "s1", listen=[f"{R1.lo}-{R1.hi}"]),
        "s2": start_server(testbed, "vfh4", "s2", listen=[f"{R2.lo}-{R2.hi}"]),
        "s3": start_server(testbed, "vfh5", "s3", rx="bpf", listen=[f"{R3.lo}-{R3.hi}"]),
    }
    testbed.wait_revision(testbed.registry.state_revision())
    yield servers


def owner_map(tb) -> list[tuple[Range, str]]:
    return [(r.range, r.owner) for r, _ in tb.registry.ranges("echo")]


def owner_of(ranges, key: int) -> str:
    return next(o for r, o in ranges if key in r)


def test_every_reply_comes_from_the_owner(testbed, echo):
    ranges = owner_map(testbed)
    assert {o for _, o in ranges} == {"s1", "s2", "s3"}
    results = run_client(testbed, "vfh2", "c-owner", count=1000, timeout=1.0)
    assert len(results) == 1000
    lost = [r for r in results if r["reply_from"] is None]
    assert not lost, f"{len(lost)} requests got no reply, e.g. {lost[:3]}"
    dups = [r for r in results if r["dup_count"]]
    assert not dups, f"duplicated replies: {dups[:3]}"
    wrong = [r for r in results if r["reply_from"] != owner_of(ranges, r["key"])]
    assert not wrong, f"{len(wrong)} replies from a non-owner, e.g. {wrong[:3]}"
    assert {r["reply_from"] for r in results} == {"s1", "s2", "s3"}


def test_cutover_moves_traffic_without_loss(testbed, echo):
    """Reassign R1 from s1 to s2 under traffic: afterwards nothing reaches s1; nothing lost or duplicated."""
    out = os.path.join(testbed.workdir, "c-cut.json")
    client = testbed.run_on("vfh3", "c-cut", client_args(testbed, "vfh3", out, keys=f"{R1.lo}-{R1.hi}",
                                                         duration=4, rate=400, timeout=1.0, count=0))
    time.sleep(1.5)
    rev = testbed.registry.assign("echo", R1, "s2")
    testbed.wait_revision(rev)
    applied_at = time.time()
    client.popen.wait(60)
    assert client.popen.returncode == 0, client.tail()
    import json

    results = json.load(open(out))
    assert len(results) > 500
    assert all(r["reply_from"] is not None for r in results), "a request was lost at the cut-over"
    assert not any(r["dup_count"] for r in results), "a request was duplicated at the cut-over"
    order = [r["reply_from"] for r in sorted(results, key=lambda r: r["seq"])]
    switch_at = order.index("s2")
    assert set(order[:switch_at]) == {"s1"} and set(order[switch_at:]) == {"s2"}, \
        "replies flip-flopped between owners: the cut-over was not atomic"
    late = [r for r in results if r["sent"] > applied_at and r["reply_from"] == "s1"]
    assert not late, f"{len(late)} requests reached the old owner after the cut-over"
    testbed.registry.assign("echo", R1, "s1")


def _desired_flow_count(tb) -> dict[int, int]:
    _, items = tb.registry.get_prefix(schema.ROOT)
    cfg = compile_fabric(FabricState.from_items({k: v for k, (v, _) in items.items()}))
    return {d: len(c.flows) for d, c in cfg.items()}


def test_controller_death_and_reconcile(testbed, echo):
    testbed.kill_controller()
    # Switches keep forwarding with the controller gone.
    results = run_client(testbed, "vfh6", "c-dead", count=300, timeout=1.0)
    assert all(r["reply_from"] is not None for r in results)
    # While it is down: a stale flow appears on a switch and a range changes in etcd.
    subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "add-flow", "vfbs1",
                    "table=1,priority=999,cookie=0x99,dl_dst=00:00:00:00:99:99,actions=drop"], check=True)
    rev = testbed.registry.assign("echo", R3, "s1")
    testbed.start_controller()
    testbed.wait_revision(rev, timeout=30)
    want = _desired_flow_count(testbed)
    for name, dpid in testbed.switches.items():
        flows = testbed.dump_flows(name)
        assert not any("cookie=0x99" in f for f in flows), "stale flow survived the reconcile"
        assert len(flows) == want[dpid], f"{name}: {len(flows)} flows installed, {want[dpid]} wanted"
    ranges = owner_map(testbed)
    results = run_client(testbed, "vfh6", "c-after", count=300, timeout=1.0)
    assert all(r["reply_from"] == owner_of(ranges, r["key"]) for r in results)
    testbed.wait_revision(testbed.registry.assign("echo", R3, "s3"))


def test_controller_stopped_while_a_range_moves_catches_up(testbed, echo):
    """SIGSTOP of the controller for 8 s (past OVS's inactivity probe: the switches drop the connection and
    forward on their own) while a range changes owner in etcd; SIGCONT: it reconnects, applies the change
    by itself, and every request goes to the new owner."""
    import signal

    pid = testbed.controller.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        results = run_client(testbed, "vfh6", "c-stopped", count=200, timeout=1.0)
        assert all(r["reply_from"] is not None for r in results), "the switches must forward on their own"
        rev = testbed.registry.assign("echo", R3, "s1")
        time.sleep(8.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    testbed.wait_revision(rev, timeout=30)
    took = time.monotonic() - t0
    ranges = owner_map(testbed)
    results = run_client(testbed, "vfh6", "c-resumed", count=300, timeout=1.0)
    assert all(r["reply_from"] == owner_of(ranges, r["key"]) for r in results)
    print(f"\ncontroller SIGSTOPped 8 s: the change applied {took:.2f} s after SIGCONT")
    testbed.wait_revision(testbed.registry.assign("echo", R3, "s3"))


def _deny_packets(tb, switch: str, port: int) -> int:
    total = 0
    for f in tb.dump_flows(switch):
        if f"priority=200,in_port={port} " in f or f"priority=200,in_port=\"{port}\"" in f or \
                re.search(rf"priority=200,in_port={port}\b", f):
            total += int(re.search(r"n_packets=(\d+)", f).group(1))
    return total


def test_port_security_drops_forged_sources(testbed, echo):
    h3 = testbed.hosts["vfh3"]
    sw = next(n for n, d in testbed.switches.items() if d == h3["dpid"])
    before = _deny_packets(testbed, sw, h3["port"])
    svc = testbed.registry.service("echo")
    forged = [testbed.hosts["vfh1"]["mac"],                      # another host's MAC
              codec.encode(svc.id, R1.lo).mac]                   # a VID owned by s1, not vfh3
    for src in forged:
        p = testbed.host("vfh3").popen([sys.executable, "-m", "vfab.testbed.sendraw", "--iface", h3["iface"],
                                        "--src", src, "--dst", codec.encode(svc.id, R2.lo).mac, "--count", "25"])
        assert p.wait(30) == 0
    deadline = time.time() + 10
    while _deny_packets(testbed, sw, h3["port"]) < before + 50 and time.time() < deadline:
        time.sleep(0.2)
    assert _deny_packets(testbed, sw, h3["port"]) == before + 50
    # The controller publishes the drop counters too.
    deadline = time.time() + 10
    while time.time() < deadline:
        got = testbed.registry.get(schema.counters_key(h3["dpid"]))
        import json

        if got and json.loads(got[0])["counters"].get(f"deny/{h3['port']}", [0])[0] >= before + 50:
            break
        time.sleep(0.3)
    else:
        pytest.fail("deny counters were not published to etcd")


def test_garbage_frames_do_not_crash_servers(testbed, echo):
    svc = testbed.registry.service("echo")
    h2 = testbed.hosts["vfh2"]
    for vid_key, server in ((R1.lo, "s1"), (R3.lo, "s3")):
        p = testbed.host("vfh2").popen([sys.executable, "-m", "vfab.testbed.sendraw", "--iface", h2["iface"],
                                        "--src", h2["mac"], "--dst", codec.encode(svc.id, vid_key).mac,
                                        "--count", "400", "--garbage"])
        assert p.wait(30) == 0
    time.sleep(0.5)
    for name, proc in echo.items():
        assert proc.alive(), f"server {name} died on garbage:\n{proc.tail()}"
    results = run_client(testbed, "vfh2", "c-garbage", count=100, timeout=1.0)
    assert all(r["reply_from"] is not None for r in results)


def test_audit_repairs_tampered_tables(testbed, echo):
    """With the controller running, a flow deleted behind its back comes back at the next audit."""
    sw = "vfbs1"
    before = len(testbed.dump_flows(sw))
    subprocess.run(["ovs-ofctl", "-O", "OpenFlow14", "del-flows", sw, "table=1,dl_dst=00:00:00:00:00:01"],
                   check=True)
    assert len(testbed.dump_flows(sw)) == before - 1
    deadline = time.time() + 30  # audits run every 10 counter polls (poll = 1 s here)
    while len(testbed.dump_flows(sw)) != before and time.time() < deadline:
        time.sleep(0.5)
    assert len(testbed.dump_flows(sw)) == before
