"""The fabric on a 3-member etcd cluster: kill -9 of the leader while a state operation runs and while the
controller reconciles.

Topology line,2,3 (vfh1-3 on vfbs1, vfh4-6 on vfbs2), etcd members vfab1-3 on loopback.  Before each kill
the leadership is handed to vfab1, the member every process lists first and so talks to: its death makes
every process (controller, KVS servers, their leases and watches, the load clients) fail over.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from vfab.testbed import fabric, history, kvs
from vfab.testbed.procs import wait_for
from vfab.vid.errors import RegistryError
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry, schema
from vfab.vid.state import ctl as statectl

HALF = Range(0x800000, 0xFFFFFF)
LOW = Range(0, 0x7FFFFF)
ALL = Range(0, 0xFFFFFF)


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, Open vSwitch)")
    tb = fabric.Testbed("line,2,3", workdir=str(tmp_path_factory.mktemp("fabric")), poll=1.0, etcd_members=3)
    tb.start()
    yield tb
    ctl_log = tb.controller.logpath if tb.controller else None
    tb.stop()
    if ctl_log:
        with open(ctl_log) as fh:
            text = fh.read()
        assert "Traceback" not in text, f"controller raised:\n{text[-3000:]}"


@pytest.fixture
def leader_dies(testbed):
    """``kill()``: hand the leadership to the first member, kill -9 it, and measure how long writes stop (a
    writer puts every 10 ms meanwhile); the member comes back after the test."""
    etcd = testbed.etcd
    first = etcd.members[0]
    out: dict = {}
    stop = threading.Event()

    def writer() -> None:
        reg = Registry(etcd.endpoint, timeout=1.0)
        while not stop.is_set():
            try:
                reg.put("/vfab-test/writer", str(time.monotonic()))
                if "killed" in out and "resumed" not in out:
                    out["resumed"] = time.monotonic() - out["killed"]
            except RegistryError:
                pass
            stop.wait(0.01)
        reg.close()

    def kill() -> None:
        threading.Thread(target=writer, daemon=True).start()
        if etcd.leader() is not first:
            etcd.make_leader(first)
            # a leader handed over and killed in the same instant is two elections at once; a leader that dies
            # has led for a while: wait until the controller has had an answer from the new term
            rev = testbed.registry.put("/vfab-test/mark", "1")
            keys = [schema.counters_key(d) for d in testbed.switches.values()]
            wait_for(lambda: all((got := testbed.registry.get(k)) and got[1] > rev for k in keys), 10,
                     "the controller's next counter report")
        first.kill9()
        out["killed"] = time.monotonic()

    out["kill"] = kill
    yield out
    stop.set()
    etcd.start()
    wait_for(lambda: etcd.healthy(), 20, "the killed member to rejoin")


def reached(reg: Registry, service: str, op_id: str, phase: str, timeout: float = 30) -> None:
    """Return as soon as the operation's record says ``phase`` (a watch: the flip lasts milliseconds)."""
    key = schema.op_key(service, op_id)
    deadline = time.monotonic() + timeout
    rec, rev = reg.op(service, op_id)
    while rec is None or rec.phase != phase or (phase == "copy" and rec.done < 200):
        assert time.monotonic() < deadline, f"the operation never reached {phase}: {rec}"
        batches, cancel = reg.watch_batches(key, rev + 1, idle=1.0)
        try:
            for batch in batches:
                for ev in batch:
                    rev = ev.revision
                    rec = schema.OpRec.from_json(ev.value, key) if ev.value else None
                break
        finally:
            cancel()


def election_bound(tb: fabric.Testbed) -> float:
    """Writes must resume within the election: raft randomises its timeout T over [T, 2T), and a split vote
    takes a second round (the bench's distribution: bench/etcd_leader_loss.py)."""
    return 4 * tb.etcd.election_ms / 1000 + 0.3


@pytest.mark.parametrize("when", ["copy", "flip"])
def test_a_split_lives_through_the_leaders_death(testbed, servers, leader_dies, when):
    """kill -9 of the etcd leader while a split copies (its flip comes after the election) or as it flips
    (its transaction may be lost with the leader: the source reads the map back and decides): the split
    ends done or failed with exactly one owner per range, no acknowledged write is lost, and etcd takes
    writes again within the election."""
    service = f"kvs-ll-{when}"
    servers(service, [("vfh1", "a", "0-0xffffff"), ("vfh4", "b", None)])
    n = 2000
    assert kvs.preload(testbed, "vfh3", service, n, value_size=256) == n
    load, out = kvs.start_load(testbed, "vfh2", f"load-ll-{when}", service, duration=10, clients=4, keys=n,
                               timeout=0.5)
    testbed.etcd.make_leader(testbed.etcd.members[0])
    started = statectl.split(testbed.registry, service, HALF, "b", throttle=1000)  # ~1 s of copying
    reached(testbed.registry, service, started.op, when)
    leader_dies["kill"]()
    op = statectl.wait(testbed.registry, service, started.op, timeout=60)
    assert op.phase in ("done", "failed"), op
    assert not [o for o in testbed.registry.ops(service) if not o.finished]
    owners = [(r.range, r.owner) for r, _ in testbed.registry.ranges(service)]
    assert owners == ([(LOW, "a"), (HALF, "b")] if op.phase == "done" else [(ALL, "a")]), (op, owners)
    doc = kvs.finish_load(testbed, load, out)
    keys = [f"k{i}" for i in range(n)]
    rows = [[-1, "PUT", k, k, 0.0, 0.0, "OK", 1] for k in keys] + doc["history"]
    report = history.check(rows, kvs.read_back(testbed, "vfh6", service, keys), time.monotonic())
    assert report["acked_puts"] > 100, report["acked_puts"]
    assert not report["violations"], "\n".join(report["violations"][:10])
    resumed = leader_dies.get("resumed")
    assert resumed is not None and resumed < election_bound(testbed), leader_dies
    print(f"\n{when}: split {op.phase} in {op.timings.get('total_s', 0):.2f} s, writes resumed "
          f"{resumed:.2f} s after the kill, {report['acked_puts']} acknowledged puts checked")


def test_the_controller_keeps_reconciling_after_the_leaders_death(testbed, servers, leader_dies):
    """The controller's watch and its reports move to another member: a range change made after the
    kill is compiled and applied on every switch, and the controller logged which member it moved to."""
    service = "kvs-ll-ctl"
    servers(service, [("vfh1", "a", "0-0xffffff"), ("vfh4", "b", None)])
    leader_dies["kill"]()
    t0 = time.monotonic()
    reg = Registry(testbed.etcd_endpoint)
    while True:
        try:
            rev = reg.assign(service, HALF, "b")
            break
        except RegistryError:
            assert time.monotonic() - t0 < 5, "no range change taken 5 s after the leader died"
            time.sleep(0.05)
    took = testbed.wait_revision(rev, timeout=10)
    # 0.03-0.54 s in the runs of 2026-12-07; 1.01 s twice on a loaded machine (a fresh-clone make test): the
    # bound is two election timeouts of etcd's default (1 s), past which the watch's failover is broken
    assert took < 2.0, f"the range change took {took:.2f} s to be applied after its write"
    flows = "\n".join(testbed.dump_flows("vfbs1") + testbed.dump_flows("vfbs2"))
    assert flows, "no flows"
    with open(testbed.controller.logpath) as fh:
        log = fh.read()
    first = testbed.etcd.members[0].endpoint
    assert f"member {first}" in log and "switching to" in log, log[-2000:]
    print(f"\nrange change applied {time.monotonic() - t0:.2f} s after the kill ({took:.2f} s after its write)")
    assert testbed.controller.alive()   # (the testbed's teardown checks its log for tracebacks)
