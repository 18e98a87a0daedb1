"""elastic-KVS on real OVS + os-ken + etcd in Mininet: state ops under load, crashes, takeover, bad input, racing operators.

Topology line,2,3: vfh1-3 on vfbs1, vfh4-6 on vfbs2.  Servers on vfh1, vfh4, vfh5
(one service per test, stopped at its end), load clients on vfh2, vfh3, vfh6.
"""

from __future__ import annotations

import threading
import time

import pytest

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import KvsError, Op, Status
from vfab.testbed import history, kvs
from vfab.testbed.procs import wait_for
from vfab.vid.state import ctl as statectl
from vfab.vid.errors import VidError
from vfab.vid.errors import NotFound
from vfab.vid.ranges import Range
from vfab.vid.registry import Registry
from vfab.vid.errors import StateError

HALF = Range(0x800000, 0xFFFFFF)


def owners(tb, service: str) -> list[tuple[Range, str]]:
    return [(r.range, r.owner) for r, _ in tb.registry.ranges(service)]


def run_op(tb, service: str, start) -> object:
    return statectl.wait(tb.registry, service, start().op, timeout=60)


def checked(tb, service: str, loads: list[dict], keys: list[str], preloaded: list[str] = ()) -> dict:
    rows = [[-1, "PUT", k, k, 0.0, 0.0, "OK", 1] for k in preloaded]
    for doc in loads:
        rows += doc["history"]
    at = time.monotonic()
    return history.check(rows, kvs.read_back(tb, "vfh2", service, keys), at)


def test_split_mirror_merge_move_under_load_lose_nothing(testbed, servers):
    servers("kvs1", [("vfh1", "a", "0-0xffffff"), ("vfh4", "b", None), ("vfh5", "c", None)])
    # one load deletes too (put:get:del 1:1:1): deletes must move with their ranges like puts
    loads = [kvs.start_load(testbed, h, f"load1-{h}", "kvs1", duration=14, clients=4, keys=300, mix=mix)
             for h, mix in (("vfh2", "1:1:0"), ("vfh3", "1:1:0"), ("vfh6", "1:1:1"))]
    time.sleep(2)
    ops = {
        "split": run_op(testbed, "kvs1", lambda: statectl.split(testbed.registry, "kvs1", HALF, "b")),
        "mirror": run_op(testbed, "kvs1", lambda: statectl.mirror(testbed.registry, "kvs1", "a", "c")),
        "merge": run_op(testbed, "kvs1", lambda: statectl.merge(testbed.registry, "kvs1", HALF, "a")),
        "move": run_op(testbed, "kvs1", lambda: statectl.move(testbed.registry, "kvs1", "a", "b")),
    }
    docs = [kvs.finish_load(testbed, p, out) for p, out in loads]
    for name, op in ops.items():
        assert op.phase == "done", f"{name}: {op}"
        assert op.done >= 1, f"{name} moved no keys: {op}"
    # move: b owns everything; c, mirror of the lower half since the mirror op, stays its mirror under b
    recs = [(r.range, r.owner, r.mirrors) for r, _ in testbed.registry.ranges("kvs1")]
    assert recs == [(Range(0, 0x7FFFFF), "b", ["c"]), (HALF, "b", [])], recs
    report = checked(testbed, "kvs1", docs, [f"k{i}" for i in range(300)])
    assert report["ops"] > 3000, report["ops"]
    assert report["acked_puts"] > 1000 and report["acked_dels"] > 100, (report["acked_puts"], report["acked_dels"])
    assert not report["failed"], f"{len(report['failed'])} requests failed, e.g. {report['failed'][:5]}"
    assert not report["violations"], "\n".join(report["violations"][:10])


@pytest.mark.parametrize("victim", ["owner", "peer"])
def test_kill_during_split_keeps_one_owner_and_every_write(testbed, servers, victim):
    service = f"kvs-kill-{victim}"
    procs = servers(service, [("vfh1", "a", "0-0xffffff"), ("vfh4", "b", None)])
    n = 3000
    assert kvs.preload(testbed, "vfh3", service, n, value_size=256) == n
    load, out = kvs.start_load(testbed, "vfh2", f"load-kill-{victim}", service, duration=20, clients=4, keys=n,
                               timeout=0.5)
    started = statectl.split(testbed.registry, service, HALF, "b", throttle=800)  # ~2 s of copying
    wait_for(lambda: (op := testbed.registry.op(service, started.op)[0]) and op.phase == "copy"
             and op.done > 200, 20, "the split to be copying")
    if victim == "owner":
        told, ended = [], {}        # an operator following the split ('vfab split' waits like this)

        def follow() -> None:
            try:
                ended["rec"] = statectl.wait(Registry(testbed.registry.endpoint), service, started.op, timeout=60,
                                             notice=told.append)
            except Exception as exc:  # noqa: BLE001 - checked below
                ended["exc"] = exc
        operator = threading.Thread(target=follow, daemon=True)
        operator.start()
        testbed.sup.kill9(procs[0])
        time.sleep(1.0)
        # The crashed owner comes back on its durable store, under the same name.
        procs[0] = kvs.start_server(testbed, "vfh1", "a", service)
        # The peer aborts by itself once its source is silent and etcd still names the owner.
        wait_for(lambda: "aborted" in open(procs[1].logpath).read(), 20, "b to abort the orphaned copy")
        # The operator is told: the record went with the dead process's lease, and the new a does not run it.
        operator.join(30)
        assert not operator.is_alive() and isinstance(ended.get("exc"), NotFound), ended
        assert "no longer runs it (it restarted)" in str(ended["exc"]) and "vanished" in told[0], (ended, told)
    else:
        testbed.sup.kill9(procs[1])
        op = statectl.wait(testbed.registry, service, started.op, timeout=30)
        assert op.phase == "failed" and "b" in op.error, op
    assert owners(testbed, service) == [(Range(0, 0xFFFFFF), "a")]
    doc = kvs.finish_load(testbed, load, out)
    report = checked(testbed, service, [doc], [f"k{i}" for i in range(n)], preloaded=[f"k{i}" for i in range(n)])
    assert report["acked_puts"] > 100
    assert not report["violations"], "\n".join(report["violations"][:10])
    if victim == "peer":  # the owner never stopped serving
        assert not report["failed"], f"{len(report['failed'])} requests failed, e.g. {report['failed'][:5]}"


def test_mirror_takes_over_when_the_owner_dies(testbed, servers):
    procs = servers("kvs-mirror", [("vfh1", "a", "0-0xffffff"), ("vfh5", "c", None)])
    op = run_op(testbed, "kvs-mirror", lambda: statectl.mirror(testbed.registry, "kvs-mirror", "a", "c"))
    assert op.phase == "done", op
    assert [r.mirrors for r, _ in testbed.registry.ranges("kvs-mirror")] == [["c"]]
    load, out = kvs.start_load(testbed, "vfh2", "load-mirror", "kvs-mirror", duration=12, clients=4, keys=300,
                               mix="1:1:1")   # the mirror must hold every acknowledged delete too
    time.sleep(3)
    testbed.sup.kill9(procs[0])
    wait_for(lambda: owners(testbed, "kvs-mirror") == [(Range(0, 0xFFFFFF), "c")], 15, "c to take over")
    doc = kvs.finish_load(testbed, load, out)
    report = checked(testbed, "kvs-mirror", [doc], [f"k{i}" for i in range(300)])
    assert report["acked_puts"] > 300 and report["acked_dels"] > 300, (report["acked_puts"], report["acked_dels"])
    assert not report["violations"], "\n".join(report["violations"][:10])
    assert not report["failed"], f"{len(report['failed'])} requests failed, e.g. {report['failed'][:5]}"


def test_a_mirror_frozen_then_killed_under_load_is_fenced_off_and_nothing_acknowledged_is_lost(testbed, servers):
    """The owner serves several batches while one waits for its mirror (pipelining).  SIGSTOP the mirror
    past the owner's 3 s wait for acks: every queued batch times out, the mirror is fenced off once (removed
    from the range in etcd), the owner serves on alone; SIGCONT it, mirror it again, then kill -9 it under
    load.  The history checker finds no acknowledged write lost and no stale read."""
    import os
    import signal

    procs = servers("kvs-mfrz", [("vfh1", "a", "0-0xffffff"), ("vfh5", "c", None)])
    op = run_op(testbed, "kvs-mfrz", lambda: statectl.mirror(testbed.registry, "kvs-mfrz", "a", "c"))
    assert op.phase == "done", op
    mirrors = lambda: [r.mirrors for r, _ in testbed.registry.ranges("kvs-mfrz")]   # noqa: E731
    load, out = kvs.start_load(testbed, "vfh2", "load-mfrz", "kvs-mfrz", duration=16, clients=4, keys=300)
    time.sleep(2)
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        wait_for(lambda: mirrors() == [[]], 10, "the frozen mirror to be fenced off")
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    # its lease ran out while it was frozen: it registers again (within a second of resuming)
    wait_for(lambda: "c" in [e.name for e in testbed.registry.endpoints("kvs-mfrz")], 5, "c to register again")
    op = run_op(testbed, "kvs-mfrz", lambda: statectl.mirror(testbed.registry, "kvs-mfrz", "a", "c"))
    assert op.phase == "done", op
    assert mirrors() == [["c"]]
    time.sleep(1)
    testbed.sup.kill9(procs[1])
    wait_for(lambda: mirrors() == [[]], 10, "the dead mirror to be fenced off")
    doc = kvs.finish_load(testbed, load, out)
    report = checked(testbed, "kvs-mfrz", [doc], [f"k{i}" for i in range(300)])
    assert report["acked_puts"] > 300
    assert not report["violations"], "\n".join(report["violations"][:10])
    assert owners(testbed, "kvs-mfrz") == [(Range(0, 0xFFFFFF), "a")]


def test_bad_input_gets_clear_errors_and_the_server_keeps_serving(testbed, servers):
    servers("kvs-bad", [("vfh1", "a", "0-0x7fffff"), ("vfh4", "b", "0x800000-0xffffff")])
    with kvs.client(testbed, "vfh2", "kvs-bad") as cli:
        assert cli.put(b"keep", b"v1") == 1
        with pytest.raises(KvsError, match="1280"):
            cli.put(b"big", b"x" * (proto.MAX_VALUE + 1))
        with pytest.raises(KvsError, match="1..128"):
            cli.put(b"", b"v")
        # The same mistakes on the wire (a client that skips the checks) and plain garbage.
        vk = proto.vkey(b"keep")
        raw = cli.api
        bad = {
            "oversized": proto.REQ.pack(2, 0, 4, 7, 1, 0, 0) + b"keep" + b"x" * (proto.MAX_VALUE + 1),
            "empty key": proto.REQ.pack(2, 0, 0, 7, 2, 0, 0) + b"v",
            "unknown op": proto.REQ.pack(9, 0, 4, 7, 3, 0, 0) + b"keep",
            "truncated": b"\x02\x00",
            "key past end": proto.REQ.pack(1, 0, 100, 7, 4, 0, 0) + b"keep",
        }
        for what, payload in bad.items():
            seq = raw.send_request(vk, payload)
            rep = raw.wait_reply(seq, timeout=2.0)
            assert rep is not None, f"{what}: no reply"
            reply = proto.parse_reply(rep.payload)
            assert reply.status is Status.BAD_REQUEST, (what, reply)
            assert reply.message, what
        assert cli.get(b"keep") == b"v1"
        assert cli.get(b"missing") is None
        assert cli.delete(b"missing") is False
    # Operator mistakes: a range nobody owns alone, a peer that is not there, a split by a non-owner.
    with pytest.raises(StateError, match="not inside one owner"):
        statectl.split(testbed.registry, "kvs-bad", Range(0x700000, 0x900000), "b")
    with pytest.raises(StateError, match="not a live stateful endpoint"):
        statectl.split(testbed.registry, "kvs-bad", Range(0, 0xFFFF), "nobody")
    with pytest.raises(StateError, match="does not own"):
        statectl.command(testbed.registry, "kvs-bad", "b", "SPLIT", {"peer": "a", "lo": 0, "hi": 0xFFFF})
    with pytest.raises(VidError):
        Range(0, 0x1000000)
    assert owners(testbed, "kvs-bad") == [(Range(0, 0x7FFFFF), "a"), (Range(0x800000, 0xFFFFFF), "b")]
    with kvs.client(testbed, "vfh3", "kvs-bad") as cli:
        assert cli.get(b"keep") == b"v1"
        ops = kvs.pipeline(cli, [(Op.PUT, f"x{i}".encode(), b"y") for i in range(200)])
        assert all(p.reply is not None and p.reply.status is Status.OK for p in ops)


def test_operators_racing_on_one_range_lose_nothing_and_end_with_one_owner(testbed, servers):
    """Two operators at once, three times, under load: the same split to two peers; a split to b while the
    upper half's owner moves (b to c, or c to b); a merge back while the lower half's owner moves.  Each operation either ends done or is refused
    or fails saying why; afterwards every key has one owner and no acknowledged write is lost."""
    service = "kvs-race"
    servers(service, [("vfh1", "a", "0-0xffffff"), ("vfh4", "b", None), ("vfh5", "c", None)])
    n = 2000
    assert kvs.preload(testbed, "vfh3", service, n, value_size=256) == n
    load, out = kvs.start_load(testbed, "vfh2", "load-race", service, duration=22, clients=4, keys=n, mix="1:1:1")
    time.sleep(1)
    reg = testbed.registry

    def race(*starts) -> list[tuple[str, str]]:
        """Start every operation at the same instant from its own thread (its own etcd client); (outcome,
        detail) of each: 'done', 'failed: <error>', or 'refused: <error>'."""
        go = threading.Barrier(len(starts))
        out: list = [None] * len(starts)

        def one(i: int, start) -> None:
            r = Registry(reg.endpoint)
            try:
                go.wait(5)
                try:
                    started = start(r)
                except (StateError, VidError) as exc:
                    out[i] = ("refused", str(exc))
                    return
                op = statectl.wait(r, service, started.op, timeout=60)
                out[i] = ("done", "") if op.phase == "done" else ("failed", op.error)
            finally:
                r.close()
        threads = [threading.Thread(target=one, args=(i, s), daemon=True) for i, s in enumerate(starts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(o is not None for o in out), out
        for outcome, detail in out:
            assert outcome == "done" or detail.strip(), out   # a refusal or failure says why
        return out + [("ranges after", str(owners(testbed, service)))]

    seen = [race(lambda r: statectl.split(r, service, HALF, "b"), lambda r: statectl.split(r, service, HALF, "c"))]
    # the upper half's owner (b or c) moves everything it has while a splits a quarter to b: b is both a
    # split's peer and a move's source, or the peer of two operations at once
    upper = owners(testbed, service)[-1][1]
    seen.append(race(lambda r: statectl.split(r, service, Range(0x400000, 0x7FFFFF), "b"),
                     lambda r: statectl.move(r, service, upper, "c" if upper == "b" else "b")))
    low_owner = next(o for rng, o in owners(testbed, service) if 0 in rng)
    seen.append(race(lambda r: statectl.merge(r, service, HALF, low_owner),
                     lambda r: statectl.move(r, service, low_owner, "b" if low_owner != "b" else "a")))
    assert any(o == "done" for race_ in seen for o, _ in race_), seen
    recs = owners(testbed, service)
    # one owner per key: the ranges tile the key space without overlap
    assert recs[0][0].lo == 0 and recs[-1][0].hi == 0xFFFFFF, recs
    assert all(a[0].hi + 1 == b[0].lo for a, b in zip(recs, recs[1:])), recs
    assert all(o in ("a", "b", "c") for _, o in recs), recs
    doc = kvs.finish_load(testbed, load, out)
    report = checked(testbed, service, [doc], [f"k{i}" for i in range(n)], preloaded=[f"k{i}" for i in range(n)])
    assert report["acked_puts"] > 500, report["acked_puts"]
    assert not report["violations"], "\n".join(report["violations"][:10])
    assert not report["failed"], f"{len(report['failed'])} requests failed, e.g. {report['failed'][:5]}; races: {seen}"


def test_a_retry_after_a_split_merge_and_move_is_answered_from_its_record(testbed, servers):
    """Issue 42: a PUT acknowledged, then its key's range split away, merged back and moved, with 20 more
    acknowledged writes of the key after each (the old memory of request ids per key held 16): the very same
    request sent again reaches the key's current owner each time and is answered from the completion record
    that moved with the key (its first reply's version), never applied again."""
    servers("kvs-retry", [("vfh1", "a", "0-0xffffff"), ("vfh4", "b", None)])
    key = b"r0"
    n = 0
    while proto.vkey(key) not in HALF:
        n += 1
        key = f"r{n}".encode()
    with kvs.client(testbed, "vfh2", "kvs-retry") as cli, kvs.client(testbed, "vfh3", "kvs-retry") as other:
        cli.retries = 40                               # the request stays valid for the whole test (deadline)
        first = cli.submit(Op.PUT, key, b"first")
        while first.reply is None and not first.error:
            cli.poll(0.1)
        assert (first.reply.status, first.reply.version) == (Status.OK, 1), first.reply
        steps = [("split", lambda: statectl.split(testbed.registry, "kvs-retry", HALF, "b"), "b"),
                 ("merge", lambda: statectl.merge(testbed.registry, "kvs-retry", HALF, "a"), "a"),
                 ("move", lambda: statectl.move(testbed.registry, "kvs-retry", "a", "b"), "b")]
        version, writes = 1, 0
        for name, start, owner in steps:
            assert run_op(testbed, "kvs-retry", start).phase == "done", name
            assert [o for r, o in owners(testbed, "kvs-retry") if proto.vkey(key) in r] == [owner], name
            for i in range(20):
                version = other.put(key, f"{name}-{i}".encode())
            writes += 20
            first.reply, first.attempts = None, 0      # the same request (client id, seq) once more
            cli.inflight[first.reqid] = first
            cli._send(first)
            while first.reply is None and not first.error:
                cli.poll(0.1)
            assert (first.reply.status, first.reply.version) == (Status.OK, 1), (name, first.reply, first.error)
            assert other.get(key) == f"{name}-19".encode() and version == 1 + writes, (name, version)
