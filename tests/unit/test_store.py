"""vid-lib/store.py against a real etcd (a private member per session, see conftest.py)."""

from __future__ import annotations

import threading
import time

import pytest

from vfab.testbed.etcd import free_port
from vfab.vid.registry import schema
from vfab.vid.codec import KEY_MAX
from vfab.vid.errors import Conflict, NotFound, RegistryError, VidError
from vfab.vid.ranges import FULL, Range, check_partition
from vfab.vid.registry import Registry
from vfab.testbed.procs import wait_for


def layout_of(registry: Registry, service: str) -> list[tuple[int, int, str, int, str]]:
    return [(r.lo, r.hi, r.owner, r.epoch, r.state) for r, _ in registry.ranges(service)]


def run_at_once(*fns):
    """Run callables in threads released by one barrier; [(result, exception)] in order."""
    barrier = threading.Barrier(len(fns))
    out: list = [None] * len(fns)

    def work(i, fn):
        barrier.wait()
        try:
            out[i] = (fn(), None)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = (None, exc)

    threads = [threading.Thread(target=work, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


# -- services ------------------------------------------------------------------------
def test_create_service_allocates_distinct_ids_and_one_unassigned_range(registry):
    a = registry.create_service("echo")
    b = registry.create_service("kvs", layout="suffix")
    assert a.id != b.id and 1 <= a.id and 1 <= b.id
    assert (b.layout, registry.service("kvs")) == ("suffix", b)
    for name in ("echo", "kvs"):
        assert layout_of(registry, name) == [(0, KEY_MAX, "", 0, "unassigned")]
    assert registry.create_service("echo") == a  # idempotent
    assert [s.name for s in registry.services()] == ["echo", "kvs"]
    assert registry.get(schema.service_id_key(a.id))[0] == b"echo"


def test_concurrent_creations_get_distinct_ids(registry, etcd_endpoint):
    regs = [Registry(etcd_endpoint) for _ in range(4)]
    results = run_at_once(*[lambda r=r, i=i: r.create_service(f"svc{i}") for i, r in enumerate(regs)])
    assert all(exc is None for _, exc in results), results
    ids = [svc.id for svc, _ in results]
    assert len(set(ids)) == 4


def test_explicit_service_id_taken(registry):
    registry.create_service("echo", sid=42)
    assert registry.service("echo").id == 42
    with pytest.raises(Conflict, match="service id 42 is taken: omit the id"):
        registry.create_service("other", sid=42)


def test_service_errors(registry):
    with pytest.raises(NotFound, match="service 'nope' does not exist .*known: none yet.*vfab service add nope"):
        registry.service("nope")
    with pytest.raises(VidError, match="invalid"):
        registry.create_service("Bad Name")
    with pytest.raises(VidError, match="unknown VID layout"):
        registry.create_service("echo", layout="middle")


def test_delete_service(registry):
    svc = registry.create_service("echo")
    registry.assign("echo", Range(0, 9), "e1")
    registry.delete_service("echo")
    assert registry.services() == []
    assert registry.get_prefix(schema.range_prefix("echo"))[1] == {}
    assert registry.get(schema.service_id_key(svc.id)) is None


# -- ranges ----------------------------------------------------------------------------
def test_assign_splits_and_keeps_the_partition(registry):
    registry.create_service("echo")
    registry.assign("echo", Range(100, 199), "e1")
    assert layout_of(registry, "echo") == [
        (0, 99, "", 1, "unassigned"), (100, 199, "e1", 1, "active"), (200, KEY_MAX, "", 1, "unassigned")]
    registry.assign("echo", Range(150, 250), "e2")
    assert layout_of(registry, "echo") == [
        (0, 99, "", 1, "unassigned"), (100, 149, "e1", 2, "active"), (150, 250, "e2", 2, "active"),
        (251, KEY_MAX, "", 2, "unassigned")]
    registry.assign("echo", FULL, "e3")
    assert layout_of(registry, "echo") == [(0, KEY_MAX, "e3", 3, "active")]
    registry.assign("echo", Range(0, 0x7FFFFF), "", state="active")
    recs = [r for r, _ in registry.ranges("echo")]
    assert [(r.owner, r.state) for r in recs] == [("", "unassigned"), ("e3", "active")]
    check_partition(r.range for r in recs)
    assert registry.owner_of("echo", 0x800000).owner == "e3"


def test_random_assignments_keep_partition_and_raise_epochs(registry):
    import random

    rng = random.Random(5)
    registry.create_service("echo")
    epochs = {}
    for i in range(25):
        lo = rng.randrange(KEY_MAX)
        r = Range(lo, rng.randrange(lo, min(KEY_MAX, lo + rng.choice([0, 10, 1 << 20, 1 << 24]))  + 1))
        before = {(x.lo, x.hi): x.epoch for x, _ in registry.ranges("echo") if x.range.overlaps(r)}
        registry.assign("echo", r, f"e{i % 3}", mirrors=["m1"] if i % 5 == 0 else None)
        recs = [x for x, _ in registry.ranges("echo")]
        check_partition(x.range for x in recs)
        new = registry.owner_of("echo", r.lo)
        assert (new.lo, new.hi, new.owner) == (r.lo, r.hi, f"e{i % 3}")
        assert new.epoch == max(before.values()) + 1
        for x in recs:  # untouched ranges keep their epoch; touched ones only go up
            assert x.epoch >= epochs.get((x.lo, x.hi), 0)
        epochs = {(x.lo, x.hi): x.epoch for x in recs}
    # Adjacent ranges may well share an owner; the map stays a partition either way.
    assert len(epochs) >= 2


def test_assign_keeps_outside_parts_owner_and_mirrors(registry):
    registry.create_service("echo")
    registry.assign("echo", Range(0, 999), "e1", mirrors=["m1"], helpers=["h1"])
    registry.assign("echo", Range(400, 599), "e2")
    recs = {r.lo: r for r, _ in registry.ranges("echo")}
    assert (recs[0].owner, recs[0].mirrors, recs[0].helpers, recs[0].hi) == ("e1", ["m1"], ["h1"], 399)
    assert (recs[600].owner, recs[600].mirrors, recs[600].hi) == ("e1", ["m1"], 999)
    assert (recs[400].owner, recs[400].mirrors, recs[400].hi) == ("e2", [], 599)


def test_assign_errors(registry):
    with pytest.raises(NotFound, match="service 'echo' does not exist"):
        registry.assign("echo", Range(0, 1), "e1")
    registry.create_service("echo")
    with pytest.raises(VidError, match="endpoint name 'E 1' is invalid"):
        registry.assign("echo", Range(0, 1), "E 1")
    with pytest.raises(Conflict, match=r"is at epoch 0, not 5: somebody changed it; re-read it"):
        registry.assign("echo", Range(0, 1), "e1", expect_epoch=5)
    registry.assign("echo", Range(0, 1), "e1", expect_epoch=0)


def test_conflicting_reassignments_with_the_same_epoch_one_wins(registry, etcd_endpoint):
    registry.create_service("echo")
    regs = [Registry(etcd_endpoint), Registry(etcd_endpoint)]
    for round_ in range(8):
        epoch = registry.owner_of("echo", 50).epoch
        lo_a, lo_b = (0, 40) if round_ % 2 else (40, 0)
        results = run_at_once(
            lambda: regs[0].assign("echo", Range(lo_a, 99), "alice", expect_epoch=epoch),
            lambda: regs[1].assign("echo", Range(lo_b, 79), "bob", expect_epoch=epoch),
        )
        wins = [res for res, exc in results if exc is None]
        losses = [exc for _, exc in results if exc is not None]
        assert len(wins) == 1 and len(losses) == 1, results
        assert isinstance(losses[0], Conflict), losses
        msg = str(losses[0])
        assert "'echo'" in msg and "retry" in msg and ("epoch" in msg or "another operator won" in msg)
        winner = "alice" if results[0][1] is None else "bob"
        assert registry.owner_of("echo", 50).owner == winner
        assert registry.owner_of("echo", 50).epoch == epoch + 1
        check_partition(r.range for r, _ in registry.ranges("echo"))


def test_a_peer_fencing_its_copy_makes_the_sources_flip_lose(registry):
    """A peer gives up its copy (its source fell silent): the fence raises the epoch of what overlaps the
    range, unchanged otherwise, so the source's flip (expecting the epoch it read) can no longer hand the
    range to a peer that dropped it.  Once the flip won, the fence says so and changes nothing."""
    registry.create_service("kvs")
    registry.assign("kvs", FULL, "a")
    half = Range(0x800000, KEY_MAX)
    before = registry.owner_of("kvs", 0)
    assert registry.fence("kvs", half, "b", "split") is None
    after = registry.owner_of("kvs", 0)
    assert (after.range, after.owner, after.epoch) == (FULL, "a", before.epoch + 1)
    with pytest.raises(Conflict):
        registry.assign("kvs", half, "b", expect_epoch=before.epoch)
    registry.assign("kvs", half, "b", expect_epoch=after.epoch)     # a flip that read the map after the fence
    won = registry.fence("kvs", half, "b", "split")
    assert won is not None and won.owner == "b" and won.range == half
    assert registry.owner_of("kvs", half.lo).epoch == after.epoch + 1   # not raised again
    registry.assign("kvs", half, "b", mirrors=["c"])
    assert registry.fence("kvs", half, "c", "mirror").mirrors == ["c"]   # a mirror copy that committed


def test_race_without_expect_epoch_stale_reads_lose(registry, etcd_endpoint):
    """Both operators read the ranges, then both commit: the later txn must fail."""
    registry.create_service("echo")
    registry.assign("echo", Range(0, 999), "e0")
    snapshot = registry.ranges("echo")

    # Raw: two transactions compare the same (now stale for one of them) mod revisions.
    key = schema.range_key("echo", 0)
    mod = next(m for r, m in snapshot if r.lo == 0)
    rec = lambda owner: schema.RangeRec(lo=0, hi=999, owner=owner, epoch=2).to_json()  # noqa: E731
    ok1, _ = registry.txn([Registry.cmp_mod(key, mod)], {key: rec("e1")})
    ok2, _ = registry.txn([Registry.cmp_mod(key, mod)], {key: rec("e2")})
    assert (ok1, ok2) == (True, False)
    assert registry.owner_of("echo", 5).owner == "e1"
    ok3, _ = registry.txn([Registry.cmp_mod(key, 0)], {key: rec("e3")})  # "must not exist"
    assert not ok3

    # Through assign(): the second operator's view is stale (it read before the first wrote).
    stale = registry.ranges("echo")
    first, second = Registry(etcd_endpoint), Registry(etcd_endpoint)
    second.ranges = lambda service: stale  # its read happened before first's commit
    first.assign("echo", Range(0, 499), "alice")
    with pytest.raises(Conflict, match=r"changed while this reassignment was prepared \(another operator won\)"):
        second.assign("echo", Range(200, 999), "bob")
    assert registry.owner_of("echo", 300).owner == "alice"
    assert registry.owner_of("echo", 700).owner == "e1"
    check_partition(r.range for r, _ in registry.ranges("echo"))


def test_racing_threads_without_expect_epoch_never_break_the_partition(registry, etcd_endpoint):
    registry.create_service("echo")
    regs = [Registry(etcd_endpoint) for _ in range(3)]
    for round_ in range(5):
        results = run_at_once(*[
            lambda r=r, i=i: r.assign("echo", Range(i * 300 + round_, 2000 - i * 300), f"op{i}")
            for i, r in enumerate(regs)])
        for _, exc in results:
            assert exc is None or isinstance(exc, Conflict), exc
        assert any(exc is None for _, exc in results)
        check_partition(r.range for r, _ in registry.ranges("echo"))


# -- endpoints and leases ----------------------------------------------------------------
def test_endpoint_lease_expires_when_refreshing_stops(registry, etcd_endpoint):
    registry.create_service("echo")
    owner = Registry(etcd_endpoint)
    ep = schema.Endpoint(service="echo", name="e1", mac="02:00:00:00:00:01", rx="bpf")
    lease = owner.announce(ep, ttl=1)
    assert lease > 0 and registry.endpoints("echo") == [ep]
    time.sleep(2.0)  # twice the TTL: the keepalive thread holds it
    assert registry.endpoints("echo") == [ep]
    owner.close()
    t0 = time.monotonic()
    wait_for(lambda: registry.endpoints("echo") == [], 6, "the endpoint gone with its lease")
    assert time.monotonic() - t0 < 4


def test_revoke_removes_the_endpoint_at_once(registry):
    registry.create_service("echo")
    ep = schema.Endpoint(service="echo", name="e2", mac="02:00:00:00:00:02")
    lease = registry.announce(ep, ttl=30)
    assert [e.name for e in registry.endpoints("echo")] == ["e2"]
    registry.revoke(lease)
    assert registry.endpoints("echo") == []


def test_keepalive_of_a_lease_etcd_lost_stops_and_says_so(registry, caplog):
    """A lease that expired (its owner was stopped past the TTL) is gone for good: its keepalive thread stops
    with one line instead of logging a failure every ttl/3 s forever; keepalive_once tells its owner (0)."""
    lease = registry.lease(1)
    registry.keepalive(lease, 1)
    name = f"lease-{lease:x}"
    assert any(t.name == name for t in threading.enumerate())
    registry.revoke(lease)
    wait_for(lambda: not any(t.name == name for t in threading.enumerate()), 3, f"thread {name} ended")
    assert "gone from etcd (expired); no longer kept alive" in caplog.text
    assert registry.keepalive_once(lease) == 0


def test_a_server_whose_lease_expired_announces_again_and_a_closed_one_does_not(registry, ns, caplog):
    """An echo server or an agent stopped past its TTL lost its lease for good: the switches never delivered
    to it again.  vid-lib's Server announces again under a new lease; after close() it stays gone."""
    from vfab.vid import api

    registry.create_service("again")
    server = api.announce(registry, "again", "e1", ns.a, rx="bpf", ttl=1, netns=f"/var/run/netns/{ns.name}")
    first = server.lease
    registry.revoke(first)                 # what etcd does when the process was stopped past its TTL
    wait_for(lambda: server.lease != first and [e.name for e in registry.endpoints("again")] == ["e1"], 5,
             "the endpoint announced again under a new lease")
    assert "announced again" in caplog.text
    server.close()
    assert registry.endpoints("again") == []
    time.sleep(1.5)                        # its keepalive thread sees the lease gone: closed, it stays gone
    assert registry.endpoints("again") == []


def test_announce_for_unknown_service(registry):
    ep = schema.Endpoint(service="ghost", name="e1", mac="02:00:00:00:00:01")
    with pytest.raises(NotFound, match="service 'ghost' does not exist"):
        registry.announce(ep)


# -- topology and misc ---------------------------------------------------------------------
def test_topology_and_config_records(registry):
    registry.put_switch(schema.Switch(dpid=2, name="s2"))
    registry.put_switch(schema.Switch(dpid=1, name="s1"))
    registry.put_link(schema.Link(1, 10, 2, 20))
    registry.put_host(schema.Host(mac="02-00-00-00-00-0A", dpid=1, port=3))
    assert [s.name for s in registry.switches()] == ["s1", "s2"]
    assert registry.get(schema.host_key("02:00:00:00:00:0a")) is not None
    registry.set_miss_policy("flood")
    assert registry.get(schema.MISS_KEY)[0] == b"flood"
    with pytest.raises(VidError, match="miss policy 'explode' is unknown"):
        registry.set_miss_policy("explode")
    registry.put(schema.applied_key(1), schema.Applied(dpid=1, revision=10, flows=3).to_json())
    assert registry.applied()[1].revision == 10
    assert registry.wait_applied(10, timeout=1, dpids=[1]) >= 0
    with pytest.raises(RegistryError, match=r"switches 0x2 have not applied revision 10 .* is the controller running"):
        registry.wait_applied(10, timeout=0.1)


def test_unreadable_record_is_a_registry_error(registry):
    registry.put(schema.service_key("echo"), "{not json")
    with pytest.raises(RegistryError, match="service at /vfab/v1/services/echo is not JSON"):
        registry.service("echo")


def test_unreachable_etcd_names_the_endpoint():
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    reg = Registry(endpoint, timeout=1.0)
    with pytest.raises(RegistryError, match=f"etcd at {endpoint} is unreachable.*vfab up"):
        reg.services()
    with pytest.raises(RegistryError, match=endpoint):
        reg.create_service("echo")


@pytest.mark.parametrize("endpoint", ["localhost", ":2379", "host:port", "127.0.0.1:0", "http://127.0.0.1:2379/v3"])
def test_malformed_endpoint(endpoint):
    with pytest.raises(RegistryError, match="is malformed: write HOST:PORT"):
        Registry(endpoint)


def test_get_many_reads_several_keys_at_one_revision(registry):
    r1 = registry.put("/vfab/t/a", "1")
    registry.put("/vfab/t/b", "2")
    rev, got = registry.get_many(["/vfab/t/a", "/vfab/t/missing", "/vfab/t/b"])
    assert got == {"/vfab/t/a": (b"1", r1), "/vfab/t/b": (b"2", r1 + 1)} and rev == r1 + 1
    assert registry.get_many([]) == (rev, {})


def test_watch_batches_deliver_a_transaction_whole(registry):
    """One delete-range of 500 keys arrives as one list: a consumer never sees half of it."""
    prefix = schema.ROOT + "ranges/wb/"
    for i in range(0, 500, 100):
        registry.txn([], {f"{prefix}{j:06x}": "{}" for j in range(i, i + 100)})
    start = registry.get_prefix(prefix)[0] + 1
    batches, cancel = registry.watch_batches(prefix, start)
    try:
        rev = registry.delete_prefix(prefix)
        registry.put(prefix + "after", "1")
        first, second = next(batches), next(batches)
    finally:
        cancel()
    assert len(first) == 500 and {e.revision for e in first} == {rev}
    assert all(e.value is None for e in first)
    assert [(e.key, e.value, e.revision) for e in second] == [(prefix + "after", b"1", rev + 1)]


def test_an_ovs_endpoint_needs_its_interface_to_itself(registry):
    from vfab.vid.errors import Conflict

    for svc in ("sa", "sb"):
        registry.create_service(svc)
    mac = "00:00:00:00:00:0a"
    registry.announce(schema.Endpoint(service="sa", name="a", mac=mac, rx="ovs"), ttl=5)
    with pytest.raises(Conflict, match="rx=ovs endpoint needs its interface to itself"):
        registry.announce(schema.Endpoint(service="sb", name="b", mac=mac, rx="bpf"), ttl=5)
    # Re-announcing the same endpoint is fine; bpf endpoints may share an interface.
    registry.announce(schema.Endpoint(service="sa", name="a", mac=mac, rx="ovs"), ttl=5)
    other = "00:00:00:00:00:0b"
    registry.announce(schema.Endpoint(service="sa", name="c", mac=other, rx="bpf"), ttl=5)
    registry.announce(schema.Endpoint(service="sb", name="d", mac=other, rx="bpf"), ttl=5)


def test_follow_reads_then_follows_and_reads_again_after_etcd_came_back(tmp_path):
    """Registry.follow (the view watcher's, the controller's and the sdhcp binder's loop): every key first,
    then each change whole; with etcd killed and restarted, one error said, every key read again, and the
    changes made while it was down are in the copy; a set stop ends it."""
    import threading
    import time

    from vfab.testbed.etcd import LocalEtcd, free_port

    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port())
    etcd.start(timeout=20)
    reg = Registry(etcd.endpoint)
    prefix = schema.ROOT + "hosts/"
    copy: dict = {}
    seen = {"resets": 0, "batches": 0, "errors": []}
    stop = threading.Event()

    def reset(items, rev):
        copy.clear()
        copy.update({k: v for k, (v, _) in items.items()})
        seen["resets"] += 1

    def apply(batch):
        for ev in batch:
            if ev.value is None:
                copy.pop(ev.key, None)
            else:
                copy[ev.key] = ev.value
        seen["batches"] += 1

    try:
        reg.put(prefix + "a", "1")
        follower = Registry(etcd.endpoint)
        th = threading.Thread(target=follower.follow, args=(prefix, reset, apply, stop),
                              kwargs={"idle": 0.5, "retry": 0.2,
                                      "on_error": lambda exc, first: seen["errors"].append(first)}, daemon=True)
        th.start()
        wait_for(lambda: copy == {prefix + "a": b"1"}, 20, "the first read", interval=0.02)
        reg.txn([], {prefix + "b": "2", prefix + "c": "3"})
        reg.delete(prefix + "a")
        wait_for(lambda: copy == {prefix + "b": b"2", prefix + "c": b"3"}, 20, "the changes", interval=0.02)
        assert seen["resets"] == 1 and seen["batches"] == 2
        time.sleep(1.2)                                   # idle renewals of the watch read nothing again
        assert seen["resets"] == 1
        etcd.kill9()
        time.sleep(1.0)
        etcd.start(timeout=20)
        reg.put(prefix + "d", "4")
        wait_for(lambda: copy.get(prefix + "d") == b"4", 20, "the change after etcd came back", interval=0.02)
        assert seen["resets"] >= 2                        # every key read again
        assert seen["errors"] and seen["errors"][0] is True and not any(seen["errors"][1:]), seen["errors"]
        stop.set()
        th.join(5)
        assert not th.is_alive()
        follower.close()
    finally:
        stop.set()
        reg.close()
        etcd.stop()


def test_an_answer_that_came_too_late_is_not_read_as_the_next_ones(tmp_path):
    """The registry keeps one HTTP connection per thread: a request that timed out (etcd SIGSTOPped) drops
    it, and a connection with unread data is not reused, so the late answer to that request is never taken
    for the answer to the next one; the registry works again as soon as etcd does."""
    import os
    import signal
    import time

    from vfab.testbed.etcd import LocalEtcd, free_port

    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port())
    etcd.start(timeout=20)
    reg = Registry(etcd.endpoint, timeout=0.5)
    other = Registry(etcd.endpoint)
    try:
        reg.put("/t/x", "1")
        os.kill(etcd.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RegistryError, match="unreachable"):
                reg.get("/t/x")                                # its answer ("1") comes after SIGCONT
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        other.put("/t/x", "2")
        got, deadline = None, time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                got = reg.get("/t/x")
                break
            except RegistryError:
                time.sleep(0.05)
        assert got is not None and got[0] == b"2", got
    finally:
        reg.close()
        other.close()
        etcd.stop()
