"""The stateful-endpoint loop on a real veth pair and a real etcd, with a small in-memory backend.

The loop runs on ``b`` of a private namespace (rx=bpf: no switch rewrites the
VIDs here); the test plays the client on ``a`` with a raw port.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from vfab.vid import codec
from vfab.vid.frame import Frame, FrameType
from vfab.vid.ranges import Range
from vfab.vid.state.backend import BadRequest, Refusal
from vfab.vid.state.loop import EndpointLoop
from vfab.vid.state.machine import Failure
from vfab.testbed.procs import wait_for

LOW = Range(0, 0x7FFFFF)


class MemBackend:
    """Payload b"<6 hex digits key>:<r|w>:<value>"; a write's record is the payload itself."""

    def __init__(self):
        self.data: dict[int, bytes] = {}
        self.batches = 0

    def key_of(self, payload: bytes) -> int:
        try:
            return int(payload[:6], 16)
        except ValueError:
            raise BadRequest(f"no key in {payload[:10]!r}") from None

    def handle_batch(self, requests):
        self.batches += 1
        replies, records = [], []
        for r in requests:
            _, op, value = r.payload.split(b":", 2)
            if op == b"w":
                self.data[r.key] = value
                records.append((r.key, r.payload))
            replies.append(b"ok:" + self.data.get(r.key, b"-"))
        return replies, records

    def error_reply(self, payload: bytes, refusal: Refusal, message: str) -> bytes:
        return f"err:{refusal.value}:{message}".encode()

    def count(self, rng):
        return sum(1 for k in self.data if k in rng)

    def snapshot(self, rng, chunk_bytes):
        yield b"", 0

    def begin_copy(self):
        return 1

    def apply(self, blobs, durable=True, gen=None):
        return 0

    def sync(self):
        pass

    def drop(self, rng, limit=None, below_gen=None):
        gone = [k for k in self.data if k in rng][:limit]
        for k in gone:
            del self.data[k]
        return len(gone)

    def keep_only(self, ranges):
        return 0


@contextmanager
def ctl_peer(loop):
    """A DEALER on the loop's control socket, as a source endpoint talks to its peer; yields
    ``ask(type, id, body, blobs=(), sender="src")`` -> the decoded answer (None for FWD, which has none)."""
    import zmq

    from vfab.vid.envelope import Envelope, decode

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(loop.ctl)

    def ask(type_, id_, body, blobs=(), sender="src"):
        dealer.send_multipart(Envelope(type_, sender, id=id_, body=body, blobs=list(blobs)).frames())
        if type_ == "FWD":
            return None
        assert dealer.poll(5000), f"no answer to {type_}"
        return decode(dealer.recv_multipart())

    try:
        yield ask
    finally:
        dealer.close()


def mirror_upper_half(loop, registry) -> Range:
    """The upper half owned by a fake endpoint ``src`` and mirrored on the loop's endpoint (e1)."""
    from vfab.vid.registry import schema

    hi = Range(0x800000, 0xFFFFFF)
    registry.announce(schema.Endpoint(service="t", name="src", mac="02:00:00:00:00:99", rx="ovs"), ttl=60)
    registry.assign("t", hi, "src", mirrors=["e1"])
    wait_for(lambda: "e1" in (loop.call(lambda: loop.view.find(hi.lo).mirrors) or []), 5, '"e1" in (loop.call(lambda: loop.view.find(hi.lo).mirrors) or [])', interval=0.005)
    return hi


def serving(ns, registry, backend):
    """The loop of endpoint e1 over ``backend``, owning the lower half, and a client port: (loop, backend,
    client, service), stopped and closed when the generator ends."""
    registry.create_service("t")
    svc = registry.service("t")
    loop = EndpointLoop(registry, "t", "e1", ns.b, backend, rx="bpf", netns=f"/var/run/netns/{ns.name}")
    stop = threading.Event()
    th = threading.Thread(target=loop.serve, args=(stop,), daemon=True)
    th.start()
    registry.assign("t", LOW, "e1")
    wait_for(lambda: loop.view.owned_by("e1") and loop.port.blocks, 5, 'loop.view.owned_by("e1") and loop.port.blocks', interval=0.005)  # the watcher's map; the port re-filtered
    assert loop.view.owned_by("e1"), "the loop never saw its range"
    client = ns.port(ns.a, rx="promisc")
    try:
        yield loop, backend, client, svc
    finally:
        stop.set()
        th.join(5)
        loop.close()
        client.close()


@pytest.fixture
def endpoint(ns, registry):
    yield from serving(ns, registry, MemBackend())


def send(client, svc, key: int, payload: bytes, seq: int) -> bytes:
    vid = codec.encode(svc.id, key).packed
    client.send(Frame(dst=vid, src=client.mac, type=FrameType.REQUEST, payload=payload, seq=seq))
    return vid


def replies(client, timeout: float = 1.0) -> list[Frame]:
    out, deadline = [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        f = client.recv(left)
        if f is not None and f.type is FrameType.REPLY:
            out.append(f)
    return out


def test_serves_from_the_vid_that_was_asked(endpoint):
    loop, backend, client, svc = endpoint
    vid = send(client, svc, 0x000123, b"000123:w:hello", 1)
    got = replies(client, 0.5)
    assert [(f.payload, f.seq) for f in got] == [(b"ok:hello", 1)]
    assert got[0].src == vid            # the VID itself, not the endpoint's MAC: clients can check it
    assert backend.data == {0x123: b"hello"}


def test_bad_and_unowned_requests_get_the_backends_errors(endpoint):
    loop, backend, client, svc = endpoint
    send(client, svc, 0x000001, b"zz:w:x", 1)              # no key: BAD_REQUEST, from the endpoint's MAC
    send(client, svc, 0x000001, b"900001:r:", 2)           # a key of nobody's range: WRONG_OWNER
    got = {f.seq: f for f in replies(client, 0.5)}
    assert got[1].payload.startswith(b"err:bad_request:no key") and got[1].src == loop.port.mac
    assert got[2].payload.startswith(b"err:wrong_owner:e1 does not own key 0x900001")
    assert backend.batches == 0


def test_a_paused_range_holds_requests_until_released(endpoint):
    loop, backend, client, svc = endpoint
    loop.call(lambda: loop.paused.__setitem__(LOW.lo, (LOW, [])))
    send(client, svc, 0x000042, b"000042:w:held", 7)
    assert replies(client, 0.4) == []
    assert backend.batches == 0
    assert loop.call(lambda: len(loop.paused[LOW.lo][1])) == 1

    def release():
        _, held = loop.paused.pop(LOW.lo)
        loop.pending.extend(held)
    loop.call(release)
    got = replies(client, 0.5)
    assert [f.payload for f in got] == [b"ok:held"]


def test_an_owner_past_its_lease_serves_nothing_until_it_is_valid_again(endpoint, monkeypatch):
    loop, backend, client, svc = endpoint
    saved = loop.lease.valid_until
    # no keepalive may make it valid again meanwhile (they come on the clock's beats, at any point of the test)
    monkeypatch.setattr(loop.lease, "tick", lambda: None)
    loop.lease.valid_until = 0.0          # as after SIGSTOP past the TTL
    send(client, svc, 0x000077, b"000077:w:late", 3)
    assert replies(client, 0.4) == []
    assert loop.call(lambda: len(loop.fenced)) == 1
    loop.lease.valid_until = saved
    got = replies(client, 0.6)
    assert [f.payload for f in got] == [b"ok:late"]


def test_the_lease_is_registered_again_after_it_expired(endpoint, registry):
    loop, backend, client, svc = endpoint
    old = loop.lease.id
    registry.revoke(old)                  # what etcd does to a lease whose owner was stopped past its TTL
    assert not [e for e in registry.endpoints("t") if e.name == "e1"]
    loop.lease.tick()                     # the next keepalive finds it gone
    assert loop.lease.id != old and loop.lease.valid
    assert [e.name for e in registry.endpoints("t")] == ["e1"]
    send(client, svc, 0x000099, b"000099:w:back", 4)
    got = replies(client, 1.0)
    assert [f.payload for f in got] == [b"ok:back"]


def test_close_from_another_thread_waits_for_the_loop_to_leave_its_pass(ns, registry):
    """close() called while serve() runs on another thread (no stop, no join): serve returns first, then the
    sockets are closed (closing a ZeroMQ socket another thread polls aborts the process); a call after
    that is refused, not hung."""
    registry.create_service("t")
    loop = EndpointLoop(registry, "t", "e1", ns.b, MemBackend(), rx="bpf", netns=f"/var/run/netns/{ns.name}")
    ended = threading.Event()
    real_serve = loop._serve

    def serve(stop: threading.Event) -> None:
        try:
            real_serve(stop)
        finally:
            ended.set()

    loop._serve = serve
    th = threading.Thread(target=loop.serve, args=(threading.Event(),), daemon=True)   # never set
    th.start()
    wait_for(lambda: loop._thread is not None and loop.lease.valid, 5, 'loop._thread is not None and loop.lease.valid', interval=0.005)
    time.sleep(0.1)   # in its poll
    closed_at = []
    real_close = loop.port.close
    loop.port.close = lambda: (closed_at.append(ended.is_set()), real_close())
    loop.close()
    assert ended.wait(1) and closed_at == [True], "the port was closed while serve() still ran"
    th.join(5)
    assert not th.is_alive()
    assert isinstance(loop.call(lambda: 1), Failure)


def test_a_lease_revoked_at_close_is_not_registered_again(registry):
    """SIGTERM: close() revokes the lease while the lease thread's keepalive is on its way; that keepalive
    finds the lease gone and registered the endpoint again under a fresh lease, which outlived the process
    by its TTL: a server started next on the same port was refused ("already carries endpoint", six
    fault tests failed in a fresh-clone run)."""
    from vfab.vid.state.lease import EndpointLease

    lease = EndpointLease(registry.endpoint, 3, name="closing")
    renewed = []
    lease.on_renewed.append(renewed.append)
    first = lease.grant()
    lease.revoke()                        # close() ...
    lease.tick()                          # ... while the keepalive sent just before it comes back
    assert lease.id == first and renewed == [], "a closed endpoint registered itself again"


def test_a_renewed_lease_serves_again_although_its_map_read_came_in_older_than_a_commit(endpoint, registry,
                                                                                     monkeypatch):
    """The map read after the lease was granted anew can reach the loop after the loop's own newer write (a
    COMMIT that came in meanwhile: etcd SIGSTOPped during a split).  The loop used to drop that read as a
    late event, and with it the generation that lets it serve: it fenced every request for good."""
    import vfab.vid.state.loop as loopmod

    loop, backend, client, svc = endpoint
    real = loopmod.read_view

    def read_then_commit(reg, service):
        view = real(reg, service)
        rev = registry.put("/vfab/v1/test-bump", "x")      # what our COMMIT's transaction did, after the read
        loop.call(lambda: setattr(loop, "min_revision", rev))
        return view

    monkeypatch.setattr(loopmod, "read_view", read_then_commit)
    registry.revoke(loop.lease.id)
    loop.lease.tick()
    send(client, svc, 0x000099, b"000099:w:back", 4)
    got = replies(client, 2.0)
    assert [f.payload for f in got] == [b"ok:back"], loop.call(lambda: dict(loop.counters))


def test_an_old_copy_is_dropped_in_steps_between_batches_unless_it_is_ours_again(endpoint):
    loop, backend, client, svc = endpoint
    backend.data.update({0x800000 + i: b"old" for i in range(2500)})   # a copy of a range we gave away
    backend.data[0x000005] = b"mine"
    loop.call(lambda: loop.forget(Range(0x800000, 0xFFFFFF)))
    wait_for(lambda: len(backend.data) <= 1, 5, "the foreign keys dropped", interval=0.02)
    assert backend.data == {0x000005: b"mine"}
    assert loop.call(lambda: loop.counters["dropped"]) == 2500
    loop.call(lambda: loop.forget(LOW))                                  # ours: never dropped
    time.sleep(0.3)
    assert backend.data == {0x000005: b"mine"} and loop.call(lambda: loop.pending_drops) == []


def test_an_old_copy_is_kept_drop_delay_after_the_move(endpoint, monkeypatch):
    """Dropped at once, an old copy's first steps met the new owner's first commits on the disk right after
    the flip (both loops stalled together); its drop now waits DROP_DELAY."""
    from vfab.vid.state import peer

    monkeypatch.setattr(peer, "DROP_DELAY", 1.0)
    loop, backend, client, svc = endpoint
    backend.data.update({0x800000 + i: b"old" for i in range(300)})
    dropped_at: list[float] = []                 # when the loop's drops ran (not when this thread looked)
    drop = backend.drop

    def timed_drop(rng, limit=None, below_gen=None):
        dropped_at.append(time.monotonic())
        return drop(rng, limit, below_gen)

    backend.drop = timed_drop
    t0 = time.monotonic()
    loop.call(lambda: loop.forget(Range(0x800000, 0xFFFFFF)))
    wait_for(lambda: not backend.data, 5, "the old copy dropped", interval=0.02)
    assert dropped_at and min(dropped_at) - t0 >= 1.0, [round(t - t0, 3) for t in dropped_at]
    assert loop.call(lambda: loop.counters["dropped"]) == 300


def test_an_old_copy_not_due_yet_does_not_hold_back_new_drop_work():
    """While an old copy waits for its DROP_DELAY, new work (a copy's clearing, which a SYNC waits for) wakes
    the dropping thread at once."""
    from types import SimpleNamespace

    from vfab.vid.state.housekeeper import Housekeeper

    steps = iter([(True, "", 30.0), (False, "", 0.0)])   # first: an old copy due in 30 s; then the new work
    loop = SimpleNamespace(name="x", call=lambda fn: fn(), drop_step=lambda: next(steps))
    hk = Housekeeper(loop)
    threading.Timer(0.1, hk.wake).start()
    t0 = time.monotonic()
    assert hk._drain_drops() is True
    assert time.monotonic() - t0 < 10


def test_a_load_report_divides_the_counts_by_the_time_they_cover():
    """The counts taken cover the time since the last take, which can be longer than LOAD_PERIOD (a wake-up
    every half period; later on a loaded machine): 30 requests over 2 s are 15 requests/s, not 30."""
    from types import SimpleNamespace

    from vfab.vid.registry import schema
    from vfab.vid.state.housekeeper import Housekeeper

    mine = [SimpleNamespace(lo=0, hi=0xFF, owner="x", range=Range(0, 0xFF))]
    loop = SimpleNamespace(name="x", call=lambda fn: fn(), take_rates=lambda: {0: 30},
                           view=SimpleNamespace(held_by=lambda name: mine), backend=SimpleNamespace(count=lambda r: 4),
                           service=SimpleNamespace(name="svc"), lease=SimpleNamespace(id=0))
    puts = []
    hk = Housekeeper(loop)
    hk._taken = time.monotonic() - 2.0
    hk._report_load(SimpleNamespace(put=lambda key, value, lease=None: puts.append(value)))
    (lo, hi, keys, rate), = schema.Load.from_json(puts[0]).ranges
    assert (lo, hi, keys) == (0, 0xFF, 4)
    assert 14.0 < rate <= 15.0


def test_a_load_report_counts_a_range_again_only_when_the_store_changed_and_not_too_often(monkeypatch):
    """An idle shard's load report reuses its count (a SQL count over 100,000 rows costs ~18 ms once the
    cache is cold, every second); after a write it counts again, but not sooner than 100x the last count's
    CPU time; a backend without count_version is counted every time."""
    from types import SimpleNamespace

    from vfab.vid.state import housekeeper as hk_mod

    clock = [1000.0]
    monkeypatch.setattr(hk_mod, "time", SimpleNamespace(monotonic=lambda: clock[0], thread_time=time.thread_time,
                                                        time=time.time))
    version, calls, cost = [7], [], [0.0]

    def count(r):
        calls.append(r)
        t0 = time.thread_time()
        while time.thread_time() - t0 < cost[0]:
            pass
        return 100 + len(calls)

    rng = Range(0, 0xFF)
    backend = SimpleNamespace(count=count, count_version=lambda: version[0])
    hk = hk_mod.Housekeeper(SimpleNamespace(backend=backend))
    assert hk._count(rng) == 101
    clock[0] += 1.0
    assert hk._count(rng) == 101 and len(calls) == 1        # unchanged: not counted again
    version[0] = 8
    assert hk._count(rng) == 102 and len(calls) == 2        # a write since: counted again
    cost[0] = 0.02                                           # an expensive count ...
    version[0] = 9
    clock[0] += 1.0
    assert hk._count(rng) == 103 and len(calls) == 3
    version[0] = 10
    clock[0] += 1.0
    assert hk._count(rng) == 103 and len(calls) == 3        # ... is not repeated within 100x its CPU time
    clock[0] += 1.5
    cost[0] = 0.0
    assert hk._count(rng) == 104 and len(calls) == 4        # after that it is
    plain = hk_mod.Housekeeper(SimpleNamespace(backend=SimpleNamespace(count=count)))
    assert plain._count(rng) == 105 and plain._count(rng) == 106


def test_the_store_data_version_moves_with_other_connections_commits_only(tmp_path):
    from vfab.vid.state.sqlstore import SqliteStore

    store = SqliteStore(str(tmp_path / "s.db"))
    store._exec_script("CREATE TABLE t (x INTEGER)")
    before = store.data_version()
    store._exec("INSERT INTO t VALUES (1)")                   # this thread's own commit
    assert store.data_version() == before
    th = threading.Thread(target=lambda: store._exec("INSERT INTO t VALUES (2)"))   # another connection's
    th.start()
    th.join()
    after = store.data_version()
    assert after != before and store.data_version() == after


def test_replicated_writes_overtake_queued_copy_chunks(endpoint):
    """A client waits on each replicated write; a copy's chunks (tens of ms each on a busy disk) must not
    queue in front of it.  Sent CHUNK x5 then REPL in one burst, the REPL is answered after at most the one
    chunk already being applied, and every chunk is still applied and answered."""
    import zmq

    from vfab.vid.envelope import Envelope, decode

    loop, backend, client, svc = endpoint
    order: list[str] = []

    def apply(blobs, durable=True, gen=None):
        order.append(blobs[0].decode())
        if blobs[0].startswith(b"chunk"):
            time.sleep(0.05)
        return 1

    backend.apply = apply
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(loop.ctl)
    try:
        hi = Range(0x800000, 0xFFFFFF)
        dealer.send_multipart(Envelope("BEGIN", "src", id=1, body={"lo": hi.lo, "hi": hi.hi}).frames())
        assert dealer.poll(5000) and decode(dealer.recv_multipart()).type == "OK"
        for i in range(5):
            dealer.send_multipart(Envelope("CHUNK", "src", id=10 + i, body={"lo": hi.lo},
                                           blobs=[f"chunk{i}".encode()]).frames())
        dealer.send_multipart(Envelope("REPL", "src", id=99, body={"lo": hi.lo}, blobs=[b"repl"]).frames())
        answered = []
        while len(answered) < 6 and dealer.poll(5000):
            env = decode(dealer.recv_multipart())
            assert env.type == "OK", env.body
            answered.append(env.id)
    finally:
        dealer.close()
    assert sorted(answered) == [10, 11, 12, 13, 14, 99]
    assert answered.index(99) <= 1, f"the replicated write waited behind the copy: answers in order {answered}"
    assert order.index("repl") <= 1 and sorted(order) == sorted([f"chunk{i}" for i in range(5)] + ["repl"])


def test_a_long_pass_of_the_loop_is_counted_by_what_took_it(endpoint):
    """A batch that holds the loop past STALL shows in STATS as stall_batch with its length, and by where its
    time went: blocked (here a sleep), running (a busy loop) or blocked in the store's commits (the disk)."""
    loop, backend, client, svc = endpoint
    count = lambda name: loop.call(lambda: loop.counters[name])   # noqa: E731
    before = {k: count(k) for k in ("stall_batch", "stall_blocked")}
    slow = backend.handle_batch
    how = {"wait": lambda: time.sleep(0.05)}

    def handle_slowly(requests):
        how["wait"]()
        return slow(requests)

    backend.handle_batch = handle_slowly
    send(client, svc, 0x000011, b"000011:w:slow", 2)
    assert [f.payload for f in replies(client, 0.5)] == [b"ok:slow"]
    assert count("stall_batch") >= before["stall_batch"] + 1
    assert count("stall_max_ms") >= 50
    assert count("stall_blocked") >= before["stall_blocked"] + 1

    def spin():
        t = time.thread_time()
        while time.thread_time() - t < 0.06:
            pass
    how["wait"] = spin
    ran = {k: count(k) for k in ("stall_on_cpu", "stall_no_cpu", "stall_blocked", "stall_disk")}
    send(client, svc, 0x000011, b"000011:w:spun", 3)
    assert [f.payload for f in replies(client, 0.5)] == [b"ok:spun"]
    # A spin is running, or runnable and waiting for a core when the machine is loaded; never blocked.
    after = {k: count(k) for k in ran}
    assert after["stall_on_cpu"] + after["stall_no_cpu"] >= ran["stall_on_cpu"] + ran["stall_no_cpu"] + 1, after
    assert (after["stall_blocked"], after["stall_disk"]) == (ran["stall_blocked"], ran["stall_disk"]), after

    disk = {"s": 0.0}                             # a commit that waits 50 ms for the disk
    backend.disk_seconds = lambda: disk["s"]

    def slow_disk():
        time.sleep(0.05)
        disk["s"] += 0.05
    how["wait"] = slow_disk
    on_disk = count("stall_disk")
    send(client, svc, 0x000011, b"000011:w:disk", 4)
    assert [f.payload for f in replies(client, 0.5)] == [b"ok:disk"]
    assert count("stall_disk") == on_disk + 1


def test_a_mirror_taking_a_range_over_serves_only_what_the_source_did_not(endpoint, registry):
    """Receiving a range it mirrors (a move), the peer buffers what the switch's mirrored delivery brings
    (hops 0) and what the source forwards (hops 1).  The source served or holds every mirrored copy, so
    once it says it paused (SYNC "paused") the peer drops those and serves at COMMIT only the forwarded
    ones: before, it served ~800 duplicates in one burst at the flip of a 100k-key move."""
    from vfab.vid.registry import schema

    loop, backend, client, svc = endpoint
    hi = mirror_upper_half(loop, registry)
    with ctl_peer(loop) as ask:
        assert ask("BEGIN", 1, {"lo": hi.lo, "hi": hi.hi, "mode": "split"}).type == "OK"
        send(client, svc, 0x800001, b"800001:w:mirrored", 1)       # the switch's copy: the source served it
        vid = codec.encode(svc.id, 0x800002).packed
        held = Frame(dst=vid, src=client.mac, type=FrameType.REQUEST, payload=b"800002:w:held", seq=2)
        deadline = time.monotonic() + 2
        while loop.call(lambda: len(loop.incoming[hi.lo].buffered)) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ask("SYNC", 2, {"lo": hi.lo, "paused": True}).type == "OK"
        ask("FWD", 3, {"hops": 1}, [held.serialize()])               # one the source held: forwarded
        deadline = time.monotonic() + 2
        while loop.call(lambda: len(loop.incoming[hi.lo].buffered)) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        rec = schema.RangeRec(lo=hi.lo, hi=hi.hi, owner="e1", mirrors=[], helpers=[], epoch=9).to_json()
        registry.assign("t", hi, "e1")
        done = ask("COMMIT", 4, {"lo": hi.lo, "rec": rec})
        assert done.type == "OK", done.body
        got = replies(client, 0.6)
    assert [(f.payload, f.seq) for f in got] == [(b"ok:held", 2)]
    assert backend.data.get(0x800001) is None and backend.data[0x800002] == b"held"
    assert loop.call(lambda: loop.counters["mirror_copies_dropped"]) == 1


def test_a_copy_given_up_or_never_begun_is_never_reported_durable(endpoint, registry):
    """SYNC answers OK only for a copy in progress from its sender.  Before, a peer that had given up a copy
    (its source silent for 6 s while etcd hung) still answered the source's last SYNC with OK, the source's
    flip then handed it the range, and every key of the split was gone."""
    loop, backend, client, svc = endpoint
    hi = mirror_upper_half(loop, registry)
    with ctl_peer(loop) as ask:
        never = ask("SYNC", 1, {"lo": hi.lo, "paused": True})
        assert never.type == "ERR" and "holds no copy" in never.body["error"], never.body
        assert ask("BEGIN", 2, {"lo": hi.lo, "hi": hi.hi, "mode": "split"}).type == "OK"
        other = ask("SYNC", 3, {"lo": hi.lo}, sender="intruder")
        assert other.type == "ERR" and "from intruder" in other.body["error"], other.body
        wait_for(lambda: ask("SYNC", 4, {"lo": hi.lo}).type == "OK", 2.0, 'ask("SYNC", 4, {"lo": hi.lo}).type == "OK"', interval=0.005)     # the copy in progress: durable
        assert ask("ABORT", 5, {"lo": hi.lo}).type == "OK"
        gone = ask("SYNC", 6, {"lo": hi.lo, "paused": True})
        assert gone.type == "ERR" and "gave the copy up" in gone.body["error"], gone.body


def test_a_mirror_that_takes_over_from_a_dead_owner_replays_what_it_ignored(endpoint, registry):
    """With a takeover replay (a backend whose requests may be served twice), the mirrored requests a mirror
    ignored for the owner in the replay window are served, in order, when it takes the range over; older
    ones and other ranges' are not.  Without it (the default) nothing is kept."""
    from vfab.vid.registry import schema

    loop, backend, client, svc = endpoint
    assert loop.replay_window == 0.0 and not loop.mirrored     # MemBackend does not ask for it
    hi = mirror_upper_half(loop, registry)
    loop.call(lambda: setattr(loop, "replay_window", 3.0))
    loop.call(lambda: loop.mirrored.append((time.monotonic() - 10, 0x800009, b"too old")))
    for seq, key in enumerate((0x800001, 0x800002, 0x800001), 1):
        send(client, svc, key, b"%06x:w:v%d" % (key, seq), seq)
    wait_for(lambda: loop.call(lambda: len(loop.mirrored)) >= 4, 2.0, 'loop.call(lambda: len(loop.mirrored)) >= 4', interval=0.005)
    assert replies(client, 0.3) == [] and backend.data.get(0x800001) is None   # a mirror ignores them
    rev = registry.assign("t", hi, "e1", expect_epoch=registry.ranges("t")[-1][0].epoch)
    loop.call(lambda: loop.took_over(schema.RangeRec(lo=hi.lo, hi=hi.hi, owner="e1", epoch=99), rev))
    got = replies(client, 0.6)
    assert [(f.payload, f.seq) for f in got] == [(b"ok:v1", 1), (b"ok:v2", 2), (b"ok:v3", 3)]
    assert backend.data[0x800001] == b"v3" and 0x800009 not in backend.data
    assert loop.call(lambda: (loop.counters["replayed"], len(loop.mirrored))) == (3, 0)


class GroupBackend(MemBackend):
    """MemBackend with group commit: every write batch needs the disk; ``sync`` waits for the test's gate
    (an fsync that takes as long as the test says) and may fail."""

    group_commit = True
    defer_sync = False
    batch_unsynced = False

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.synced: list[dict] = []       # what each sync covered (the data as it was when it began)
        self.fail = ""

    def handle_batch(self, requests):
        replies, records = super().handle_batch(requests)
        self.batch_unsynced = bool(records) and self.defer_sync
        return replies, records

    def sync(self):
        seen = dict(self.data)
        self.gate.wait(5)
        if self.fail:
            from vfab.vid.state.backend import BackendError
            raise BackendError(self.fail)
        self.synced.append(seen)


@pytest.fixture
def group_endpoint(ns, registry):
    backend = GroupBackend()
    gen = serving(ns, registry, backend)
    got = next(gen)
    assert backend.defer_sync and got[0].group_commit
    try:
        yield got
    finally:
        backend.gate.set()   # a test that failed with the disk held must not hold up the loop's stop
        gen.close()


def test_group_commit_answers_only_after_an_fsync_that_covers_the_batch_and_in_order(group_endpoint):
    """Batches the port holds one behind the other commit without waiting for the disk; once the port is
    drained one fsync covers them all, and only then do their replies leave, in order (reads behind writes
    too).  A write that arrives alone is answered after its own fsync."""
    loop, backend, client, svc = group_endpoint
    loop.call(lambda: setattr(loop, "batch_max", 1))       # one request per batch: four batches
    held = threading.Event()
    loop.call(lambda: held.wait(5), wait=False)            # the loop is busy while the burst arrives
    for seq, payload in ((1, b"000001:w:a"), (2, b"000002:w:b"), (3, b"000003:w:c"), (4, b"000001:r:")):
        send(client, svc, int(payload[:6], 16), payload, seq)
    backend.gate.clear()                                   # the disk is slow now
    held.set()
    wait_for(lambda: backend.data == {1: b"a", 2: b"b", 3: b"c"}, 2.0, 'backend.data == {1: b"a", 2: b"b", 3: b"c"}', interval=0.005)
    assert replies(client, 0.3) == []                      # nothing acknowledged before the disk
    backend.gate.set()
    got = replies(client, 1.0)
    assert [(f.seq, f.payload) for f in got] == [(1, b"ok:a"), (2, b"ok:b"), (3, b"ok:c"), (4, b"ok:a")]
    assert backend.synced == [{1: b"a", 2: b"b", 3: b"c"}]  # one fsync for the three write batches
    send(client, svc, 0x000002, b"000002:w:d", 5)
    assert [(f.seq, f.payload) for f in replies(client, 1.0)] == [(5, b"ok:d")]
    assert backend.synced[-1] == {1: b"a", 2: b"d", 3: b"c"} and len(backend.synced) == 2
    assert loop.call(lambda: (len(loop.disk_wait), loop.counters["sync_failed"])) == (0, 0)


def test_a_slow_group_fsync_is_counted(group_endpoint):
    """An fsync that held replies past STALL shows in STATS (sync_slow, sync_max_ms); a fast one does not
    count as slow.  No pass of the loop is long meanwhile: only these counters show such a wait."""
    loop, backend, client, svc = group_endpoint
    count = lambda name: loop.call(lambda: loop.counters[name])   # noqa: E731
    send(client, svc, 0x000004, b"000004:w:fast", 1)
    assert [f.payload for f in replies(client, 0.5)] == [b"ok:fast"]
    assert count("sync_slow") == 0 and count("sync_max_ms") < 20
    backend.gate.clear()
    send(client, svc, 0x000004, b"000004:w:slow", 2)
    time.sleep(0.08)
    backend.gate.set()
    assert [f.payload for f in replies(client, 0.5)] == [b"ok:slow"]
    assert count("sync_slow") == 1 and count("sync_max_ms") >= 70


def test_unordered_replies_that_need_no_disk_leave_before_an_earlier_batchs_fsync(group_endpoint):
    """A backend whose disk-free replies promise nothing (``ordered_replies = False``, sdhcp's OFFERs): a read
    served after a write answers at once, while the write's reply still waits for the disk; in order
    (the default) the read would wait behind it."""
    loop, backend, client, svc = group_endpoint
    loop.call(lambda: (setattr(loop, "batch_max", 1), setattr(loop, "ordered_replies", False)))
    held = threading.Event()
    loop.call(lambda: held.wait(5), wait=False)            # the loop is busy while both arrive
    send(client, svc, 0x000001, b"000001:w:a", 1)
    send(client, svc, 0x000003, b"000003:r:", 2)
    backend.gate.clear()                                   # the disk is slow now
    held.set()
    assert [(f.seq, f.payload) for f in replies(client, 0.5)] == [(2, b"ok:-")]
    backend.gate.set()
    assert [(f.seq, f.payload) for f in replies(client, 1.0)] == [(1, b"ok:a")]


class FakeMirror:
    """A ROUTER socket playing endpoint m1, the mirror of the loop's range: the test takes the REPLs the owner
    sends (``take``) and answers each when it chooses (``answer``)."""

    def __init__(self, loop, registry):
        import zmq

        from vfab.vid.registry import schema

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        registry.announce(schema.Endpoint(service="t", name="m1", mac="02:00:00:00:00:98", rx="ovs",
                                          ctl=f"tcp://127.0.0.1:{port}"), ttl=60)
        registry.assign("t", LOW, "e1", mirrors=["m1"])
        wait_for(lambda: loop.call(lambda: (loop.view.find(LOW.lo).mirrors, "m1" in loop.view.endpoints))
              == (["m1"], True), 5, 'loop.call(lambda: (loop.view.find(LOW.lo).mirrors, "m1" in loop.view.endpoints)) == (["m1"], True)', interval=0.005)

    def take(self, n: int, timeout: float = 1.0) -> list:
        """The next ``n`` messages (ident, envelope), or fewer if the timeout passes first."""
        from vfab.vid.envelope import decode

        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            ident, *rest = self.sock.recv_multipart()
            got.append((ident, decode(rest)))
        return got

    def answer(self, msg, type_: str = "OK") -> None:
        ident, env = msg
        self.sock.send_multipart([ident, *env.reply(type_, "m1", applied=len(env.blobs), error="refused").frames()])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def mirrored(endpoint, registry):
    loop, backend, client, svc = endpoint
    mirror = FakeMirror(loop, registry)
    try:
        yield loop, backend, client, svc, mirror
    finally:
        mirror.close()


def test_a_slow_acknowledgement_of_replicated_writes_is_counted(mirrored):
    """The owner's batch waits for its mirror's ack: a wait past STALL shows in STATS as repl_wait_slow and
    repl_wait_max_ms; a quick one does not count as slow."""
    loop, backend, client, svc, mirror = mirrored
    count = lambda name: loop.call(lambda: loop.counters[name])   # noqa: E731
    send(client, svc, 0x000006, b"000006:w:fast", 1)
    mirror.answer(mirror.take(1)[0])
    assert [f.payload for f in replies(client, 1.0)] == [b"ok:fast"]
    assert count("repl_wait_slow") == 0
    send(client, svc, 0x000006, b"000006:w:slow", 2)
    repl = mirror.take(1)
    time.sleep(0.08)
    mirror.answer(repl[0])
    assert [f.payload for f in replies(client, 1.0)] == [b"ok:slow"]
    assert count("repl_wait_slow") == 1 and count("repl_wait_max_ms") >= 70


def test_batches_are_served_while_one_waits_for_its_mirror_and_their_replies_leave_in_order(mirrored):
    """While a write waits for its mirror, the next batches are served (their writes reach the mirror at
    once) but every reply waits for the batches before it: a read of the waiting write's key is answered
    only after that write's ack, and the replies leave in the order the batches were served."""
    loop, backend, client, svc, mirror = mirrored
    loop.call(lambda: setattr(loop, "batch_max", 1))       # one request per batch
    send(client, svc, 0x000007, b"000007:w:first", 1)
    first = mirror.take(1)
    assert len(first) == 1
    send(client, svc, 0x000008, b"000008:w:second", 2)
    send(client, svc, 0x000007, b"000007:r:", 3)
    second = mirror.take(1)
    assert len(second) == 1, "the second write waited for the first one's ack before it was served"
    wait_for(lambda: backend.data.get(0x000007) == b"first" and backend.batches >= 3, 2.0, 'backend.data.get(0x000007) == b"first" and backend.batches >= 3', interval=0.005)
    mirror.answer(second[0])
    assert replies(client, 0.3) == [], "a reply left before an earlier batch's ack"
    mirror.answer(first[0])
    got = replies(client, 1.0)
    assert [(f.seq, f.payload) for f in got] == [(1, b"ok:first"), (2, b"ok:second"), (3, b"ok:first")]
    assert loop.call(lambda: len(loop.inflights)) == 0


def test_no_batch_is_served_before_a_waiting_call_and_the_call_waits_for_the_queue(mirrored):
    """A call from the operation's thread runs with no batch waiting for its peers: once one is queued, the
    loop serves no further batch until the queue drained and the call ran."""
    loop, backend, client, svc, mirror = mirrored
    send(client, svc, 0x000009, b"000009:w:a", 1)
    first = mirror.take(1)
    ran = []
    loop.call(lambda: ran.append(len(loop.inflights)), wait=False)
    send(client, svc, 0x00000A, b"00000a:w:b", 2)
    assert mirror.take(1, 0.3) == [] and ran == [], "a batch was served before the waiting call"
    mirror.answer(first[0])
    second = mirror.take(1)
    assert ran == [0] and len(second) == 1
    mirror.answer(second[0])
    assert [f.seq for f in replies(client, 1.0)] == [1, 2]


def test_a_batch_that_cannot_be_made_safe_turns_the_batches_queued_behind_it_unavailable(mirrored, monkeypatch):
    """The first write's mirror refuses it and cannot be fenced off (etcd unreachable, here patched): that write
    and every batch served behind it (which may have read it, as the read here did) are answered
    UNAVAILABLE, though the later write's own ack came."""
    loop, backend, client, svc, mirror = mirrored
    loop.call(lambda: setattr(loop, "batch_max", 1))
    monkeypatch.setattr(loop, "_peer_failed", lambda peer, why: (False, None))
    send(client, svc, 0x00000B, b"00000b:w:x", 1)
    first = mirror.take(1)
    send(client, svc, 0x00000C, b"00000c:w:y", 2)
    send(client, svc, 0x00000B, b"00000b:r:", 3)
    second = mirror.take(1)
    wait_for(lambda: backend.batches >= 3, 2.0, 'backend.batches >= 3', interval=0.005)
    mirror.answer(second[0])
    mirror.answer(first[0], "ERR")
    got = replies(client, 1.0)
    assert [f.seq for f in got] == [1, 2, 3]
    assert all(f.payload.startswith(b"err:unavailable:") for f in got), [f.payload for f in got]


def test_a_failed_group_fsync_answers_its_writes_unavailable(group_endpoint):
    loop, backend, client, svc = group_endpoint
    backend.fail = "disk I/O error"
    send(client, svc, 0x000005, b"000005:w:x", 7)
    got = replies(client, 1.0)
    assert [(f.seq, f.payload[:16]) for f in got] == [(7, b"err:unavailable:")], got
    assert b"could not be synced: disk I/O error" in got[0].payload
    assert loop.call(lambda: loop.counters["sync_failed"]) == 1


def test_a_failure_repeating_at_the_request_rate_is_logged_once_per_period(monkeypatch, caplog):
    import logging

    from vfab.vid.state import faillog
    now = [100.0]
    monkeypatch.setattr(faillog.time, "monotonic", lambda: now[0])
    fl = faillog.FailureLog(logging.getLogger("vfab.test.failurelog"), "a batch", every=10.0)
    with caplog.at_level(logging.WARNING, logger="vfab.test.failurelog"):
        for i in range(400):               # a full disk: every batch for 25 s (16 a second)
            now[0] += 0.0625
            fl.failed("s1", f"database or disk is full ({i})")
        fl.succeeded("s1")
        fl.succeeded("s1")                 # nothing to say twice
        now[0] += 1
        fl.failed("s1", "again")           # a new episode is logged at once
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "s1: a batch failed: database or disk is full (0)"
    assert lines[1] == ("s1: a batch failed 160 more time(s) in the last 10 s (161 in a row), latest: "
                        "database or disk is full (160)")
    assert lines[2].startswith("s1: a batch failed 160 more time(s)") and "(321 in a row)" in lines[2]
    assert lines[3] == "s1: a batch works again after 400 failure(s)"
    assert lines[4] == "s1: a batch failed: again"
    assert len(lines) == 5


def test_progress_writer_writes_the_newest_record_and_nothing_after_close(registry):
    """Progress records leave the operation's thread; the newest waiting one wins.  ``close`` does not wait
    for a write under way (an etcd round trip at every operation's end): that write compares the revision
    it last saw, so it cannot overwrite the final record written after ``close``."""
    from vfab.vid.registry import schema
    from vfab.vid.state.runner import ProgressWriter

    key = schema.op_key("t", "op-progress-test")
    w = ProgressWriter(registry.endpoint, key, lambda: None)
    real, gate, written = w._reg.txn, threading.Event(), []

    def held_txn(compares, puts, deletes=(), lease=None):  # etcd slow to answer
        gate.wait(5)
        ok, rev = real(compares, puts, deletes, lease=lease)
        written.append((puts[key], ok))
        return ok, rev

    w._reg.txn = held_txn
    w.post("one")
    wait_for(lambda: w._waiting is None, 2.0, 'w._waiting is None', interval=0.005)          # the thread took it and waits for "etcd"
    w.post("two")
    w.post("three")                            # only the newest waiting record is written
    gate.set()
    wait_for(lambda: len(written) == 2, 2.0, 'len(written) == 2', interval=0.005)
    assert written == [("one", True), ("three", True)]
    gate.clear()
    w.post("late")
    wait_for(lambda: w._waiting is None, 2.0, 'w._waiting is None', interval=0.005)          # under way, held by "etcd"
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 0.2, "close() waited for the write under way"
    registry.put(key, "final")                 # the runner's final record, sent before that write lands
    gate.set()
    wait_for(lambda: len(written) == 3, 2.0, 'len(written) == 3', interval=0.005)
    w.post("after close")                      # ignored: nothing writes any more
    time.sleep(0.2)
    assert registry.get(key)[0] == b"final" and written[2] == ("late", False) and len(written) == 3


def test_a_progress_writer_that_must_read_the_revision_first_writes_nothing_once_closed(registry):
    """Its last write failed (etcd blipped), so the next one reads the record's revision first.  Were that
    read answered after the final record, the write would compare against the final record's revision and
    overwrite it: once closed, nothing read afterwards is written."""
    from vfab.vid.registry import schema
    from vfab.vid.state.runner import ProgressWriter

    key = schema.op_key("t", "op-progress-reread")
    w = ProgressWriter(registry.endpoint, key, lambda: None)
    real_get, gate, txns = w._reg.get, threading.Event(), []
    real_txn = w._reg.txn

    def held_get(k):
        gate.wait(5)
        return real_get(k)

    def counted_txn(*a, **kw):
        txns.append(a)
        return real_txn(*a, **kw)

    w._reg.get, w._reg.txn = held_get, counted_txn
    w.post("copy 100")                         # _rev is None: the thread reads the revision first
    wait_for(lambda: w._waiting is None, 2.0, 'w._waiting is None', interval=0.005)
    w.close()
    registry.put(key, "final")
    gate.set()                                 # the read now answers with the final record's revision
    time.sleep(0.3)
    assert registry.get(key)[0] == b"final" and txns == []


def test_a_progress_write_etcd_applies_late_cannot_overwrite_the_final_record(registry):
    """etcd hung: the client gave up on a progress write, but etcd applies it after the final record
    (seen with etcd SIGSTOPped during a split): it compares the revision it saw and changes nothing."""
    from vfab.vid.errors import RegistryError
    from vfab.vid.registry import schema
    from vfab.vid.state.runner import ProgressWriter

    for first in (False, True):   # before the first record was written, and after it
        key = schema.op_key("t", f"op-late-{first}")
        w = ProgressWriter(registry.endpoint, key, lambda: None)
        if first:
            w.written(registry.txn([registry.cmp_mod(key, 0)], {key: "prepare"})[1])
        real, late = w._reg.txn, []

        def lost_txn(compares, puts, deletes=(), lease=None, real=real, late=late):
            late.append(lambda: real(compares, puts, deletes, lease=lease))
            raise RegistryError("etcd at 127.0.0.1:2379 is unreachable (ReadTimeout)")

        w._reg.txn = lost_txn
        w.post("copy 100")
        wait_for(lambda: late, 2.0, 'late', interval=0.005)
        w.close()
        registry.put(key, "final")             # the runner's final record
        ok, _ = late[0]()                      # etcd wakes up and applies the old request
        assert not ok and registry.get(key)[0] == b"final", first


def test_the_view_watchers_two_threads_hand_views_over_in_the_order_they_made_them():
    """The endpoints thread made its first view (no ranges yet, revision 0) before the ranges thread made
    its own, but handed it over after: the loop kept the empty one, and a shard that had just claimed its
    range answered everything "unroutable" until the next event (15 s once in bench/sdhcp_lease.py)."""
    from vfab.vid.state.view import ViewWatcher

    got, later = [], []

    def on_view(view):
        if not later:   # the first view: a second thread makes and hands over a newer one meanwhile
            def newer():
                w._revs[0] = 5
                w._emit()
            later.append(threading.Thread(target=newer))
            later[0].start()
            later[0].join(0.3)
        got.append(view.revision)

    w = ViewWatcher("127.0.0.1:1", "t", on_view)
    w._emit()
    later[0].join(2)
    assert got == [0, 5]


def test_a_loop_that_gets_a_cpu_late_after_a_wakeup_says_so(endpoint):
    """Requests can wait with no long pass at all: the loop's thread woke for them but waited for a CPU (its
    run-queue delay, from /proc).  Counted (stall_wakeup, stall_wakeup_max_ms) and logged."""
    loop, backend, client, svc = endpoint
    state = {"base": loop.call(loop._queued), "armed": 0}

    def fake_queued():
        if state["armed"]:
            state["armed"] += 1
            if state["armed"] == 3:              # the first read after the pass that armed it: the next wakeup
                state["base"] += 0.04
                state["armed"] = 0
        return state["base"]
    loop.call(lambda: setattr(loop, "_queued", fake_queued))
    before = loop.call(lambda: loop.counters["stall_wakeup"])
    loop.call(lambda: state.update(armed=1))
    send(client, svc, 0x000012, b"000012:w:late", 5)
    assert [f.payload for f in replies(client, 0.5)] == [b"ok:late"]
    assert loop.call(lambda: loop.counters["stall_wakeup"]) == before + 1
    assert loop.call(lambda: loop.counters["stall_wakeup_max_ms"]) >= 40


def test_ping_names_the_ops_whose_record_the_loop_still_writes(endpoint):
    """An operator whose op record vanished (the lease expired) asks the source with PING whether the record
    comes back: the running op, and an ended one until its final record is written, are named."""
    from types import SimpleNamespace

    loop = endpoint[0]
    op = SimpleNamespace(id="e1.00c0ffee", peer="e2", ranges=[LOW])
    with ctl_peer(loop) as ask:
        assert ask("PING", 1, {}).body["ops"] == []
        loop.call(lambda: setattr(loop, "op", op))
        assert ask("PING", 2, {}).body["ops"] == [op.id]
        loop.call(lambda: loop.op_ended(op))
        assert loop.op is None and ask("PING", 3, {}).body["ops"] == [op.id]   # its end not yet in etcd
        loop.call(lambda: loop.op_recorded(op.id))
        assert ask("PING", 4, {}).body["ops"] == []


def test_keepalives_of_different_leases_go_out_on_the_same_beats(monkeypatch):
    """Every lease of a period sends on the wall clock's multiples of it, so etcd wakes once for all of
    them (bench/sdhcp_lease.py's idle CPU); the wait is never longer than one period."""
    from vfab.vid.registry.etcd import until_beat
    from vfab.vid.state.lease import EndpointLease

    assert until_beat(0.5, 10.0) == 0.5 and until_beat(0.5, 10.1) == pytest.approx(0.4)
    assert all(0 < until_beat(1 / 3, 1e9 + i / 7) <= 1 / 3 for i in range(50))
    sent: dict[str, list[float]] = {"a": [], "b": []}
    leases = []
    for name in sent:
        lease = EndpointLease("127.0.0.1:9", 1, name=name)   # nothing listens: keepalive_once is replaced
        monkeypatch.setattr(lease.reg, "keepalive_once", lambda _id, name=name: sent[name].append(time.time()) or 1)
        leases.append(lease)
    leases[0].start()
    time.sleep(0.15)                       # started apart ...
    leases[1].start()
    time.sleep(1.3)
    for lease in leases:
        lease.stop()
    period = 1 / 3
    for name, times in sent.items():
        assert len(times) >= 3, (name, times)
        # ... they send together: within 30 ms after a beat (a thread's wake-up on a loaded machine)
        off = [min(t % period, period - t % period) for t in times]
        assert max(off) < 0.03, (name, [round(o, 3) for o in off])


# -- issue 42: a paused owner must not forward or acknowledge what it held as if fresh -------------------------
def taken_over(loop, registry, by: str = "m1") -> int:
    """``by`` takes the loop's range over (what a mirror does once the owner's lease expired); its new epoch."""
    registry.assign("t", LOW, by, mirrors=[])
    wait_for(lambda: loop.call(lambda: loop.view.find(LOW.lo).owner) == by, 5, 'loop.call(lambda: loop.view.find(LOW.lo).owner) == by', interval=0.005)
    return loop.call(lambda: loop.view.find(LOW.lo).epoch)


def test_requests_held_while_fenced_are_dropped_not_forwarded_once_the_range_moved_on(mirrored, registry,
                                                                                        monkeypatch):
    """Issue 42: an owner stopped past its lease holds what reaches it; its mirror takes the range over and
    serves; on resuming, the old owner forwarded what it held to the new owner as if fresh, and one PUT was
    applied again over newer acknowledged writes.  Now what it held under the old epoch is dropped (the
    clients retried at the new owner meanwhile); what reaches it afterwards is forwarded, stamped with the
    epoch it was routed by."""
    loop, backend, client, svc, mirror = mirrored
    saved = loop.lease.valid_until
    monkeypatch.setattr(loop.lease, "tick", lambda: None)
    loop.lease.valid_until = 0.0                        # stopped past its lease
    send(client, svc, 0x000020, b"000020:w:held", 1)
    wait_for(lambda: loop.call(lambda: len(loop.fenced)) == 1, 2.0, 'loop.call(lambda: len(loop.fenced)) == 1', interval=0.005)
    assert loop.call(lambda: len(loop.fenced)) == 1
    epoch = taken_over(loop, registry)
    loop.lease.valid_until = saved                      # registered again, the new map read
    wait_for(lambda: loop.call(lambda: loop.counters["fenced_dropped"]) == 1, 2.0, 'loop.call(lambda: loop.counters["fenced_dropped"]) == 1', interval=0.005)
    assert loop.call(lambda: (loop.counters["fenced_dropped"], loop.fenced)) == (1, [])
    assert mirror.take(1, 0.5) == [], "a request held under the old epoch was forwarded to the new owner"
    assert backend.batches == 0 and replies(client, 0.2) == []
    # a request that reaches it now is forwarded, stamped with the epoch it was routed by (one a third endpoint
    # forwarded here: rx=bpf, the port no longer takes the range's VIDs from the wire)
    vid = codec.encode(svc.id, 0x000021).packed
    raw = Frame(dst=vid, src=client.mac, type=FrameType.REQUEST, payload=b"000021:w:new", seq=2).serialize()
    loop.call(lambda: loop.pending.append((raw, 1)))
    (_, fwd), = mirror.take(1)
    assert (fwd.type, fwd.body["epoch"], fwd.body["hops"]) == ("FWD", epoch, 2)


def test_a_forward_stamped_with_an_older_epoch_than_the_owners_is_refused(endpoint):
    loop, backend, client, svc = endpoint
    epoch = loop.call(lambda: loop.view.find(LOW.lo).epoch)
    vid = codec.encode(svc.id, 0x000030).packed

    def frame(value: bytes, seq: int) -> bytes:
        return Frame(dst=vid, src=client.mac, type=FrameType.REQUEST, payload=b"000030:w:" + value,
                     seq=seq).serialize()

    with ctl_peer(loop) as ask:
        ask("FWD", 1, {"hops": 1, "epoch": epoch - 1}, [frame(b"stale", 1)])
        assert replies(client, 0.4) == [] and backend.batches == 0
        assert loop.call(lambda: loop.counters["stale_forwards_refused"]) == 1
        ask("FWD", 2, {"hops": 1, "epoch": epoch}, [frame(b"fresh", 2)])
        assert [(f.payload, f.seq) for f in replies(client, 0.5)] == [(b"ok:fresh", 2)]


def test_a_mirror_refuses_writes_replicated_under_an_epoch_before_it_took_the_range_over(endpoint):
    """The old owner's REPL that arrives after the takeover: applied, it would land behind the new owner's
    writes (version-gated, or over them) and the old owner would acknowledge it; refused, the old owner's
    fence answers its clients 'unavailable' and they retry at the new owner."""
    loop, backend, client, svc = endpoint
    epoch = loop.call(lambda: loop.view.find(LOW.lo).epoch)
    with ctl_peer(loop) as ask:
        got = ask("REPL", 1, {"durable": True, "epochs": {str(LOW.lo): epoch - 1}}, [b"000031:w:old"], sender="src")
        assert got.type == "ERR" and f"it is e1's at epoch {epoch} now" in got.body["error"], got.body
        assert ask("REPL", 2, {"durable": True, "epochs": {}}, [b"x"], sender="src").type == "OK"
    assert loop.call(lambda: loop.counters["stale_repl_refused"]) == 1


def test_the_mirror_ack_fence_checks_every_range_it_acknowledges_for(mirrored, registry):
    """Issue 42: the owner's batch waits for its mirror's ack; meanwhile the mirror took the range over (the
    owner was stopped past its lease) and refuses the write.  Fencing the mirror off, the owner looked only at
    the ranges it still owned: with none, it reported success and acknowledged a write the new owner never
    had.  Now every range the batch wrote to must still be the owner's, or the write is 'unavailable'."""
    loop, backend, client, svc, mirror = mirrored
    send(client, svc, 0x000040, b"000040:w:x", 1)
    (msg,) = mirror.take(1)
    epoch = loop.view.find(LOW.lo).epoch
    t0 = time.monotonic()
    registry.assign("t", LOW, "m1", mirrors=[])   # taken over (the loop's view follows once no batch waits)
    mirror.answer(msg, "ERR")
    got = replies(client, 1.0)
    assert time.monotonic() - t0 < 2.0, "the batch timed out instead of taking the mirror's refusal"
    # the refusal closed the socket it came on (the mirror is dropped): the loop's thread lives on
    assert loop.call(lambda: 1, timeout=2) == 1, "the loop's thread died"
    assert [f.seq for f in got] == [1] and got[0].payload.startswith(b"err:unavailable:"), got
    assert msg[1].type == "REPL" and msg[1].body.get("epochs") == {str(LOW.lo): epoch}   # for the mirror's check


def test_requests_that_came_while_away_are_dropped_when_the_new_map_is_read_first(mirrored, registry,
                                                                                   monkeypatch):
    """On SIGCONT the view watcher (or the lease keeper registering again) can hand the loop the new map before
    it reads its port: what waits there was routed here under the old map while the endpoint had no
    authority.  Seen in testbed/kvs_pause.py: one such PUT was forwarded to the new owner.  It is dropped."""
    loop, backend, client, svc, mirror = mirrored
    monkeypatch.setattr(loop.port, "accepts", lambda dst: True)   # as rx=ovs: the switch routed it here
    monkeypatch.setattr(loop.lease, "tick", lambda: None)
    saved = loop.lease.valid_until
    loop.lease.valid_until = 0.0                                     # stopped past its lease
    go = threading.Event()
    loop.call(lambda: go.wait(5), wait=False)                        # the loop is held: it reads nothing
    wait_for(lambda: not loop.calls, 2.0, 'not loop.calls', interval=0.005)
    send(client, svc, 0x000050, b"000050:w:waited", 1)
    registry.assign("t", LOW, "m1", mirrors=[])                      # meanwhile the map changes
    wait_for(lambda: len(loop.calls) >= 1, 5, 'len(loop.calls) >= 1', interval=0.005)                            # and the watcher handed it to the loop
    go.set()
    wait_for(lambda: loop.call(lambda: loop.counters["fenced_dropped"]) == 1, 5, 'loop.call(lambda: loop.counters["fenced_dropped"]) == 1', interval=0.005)
    loop.lease.valid_until = saved
    assert loop.call(lambda: (loop.counters["fenced_dropped"], loop.counters["fenced"])) == (1, 0)
    assert mirror.take(1, 0.5) == [], "a request that came while away was forwarded to the new owner"
    assert backend.batches == 0


def test_a_split_asked_as_a_merge_is_recorded_as_a_merge(endpoint, registry, monkeypatch):
    """'vfab merge' sends SPLIT with "merge": the record of the op says "merge" (source: the owner giving the
    range, peer: the endpoint taking it), and a plain SPLIT still says "split"."""
    from vfab.vid.registry import schema
    from vfab.vid.state.runner import OpRunner

    loop = endpoint[0]
    registry.announce(schema.Endpoint(service="t", name="e2", mac="02:00:00:00:00:98", ctl="tcp://127.0.0.1:9"),
                      ttl=60)
    monkeypatch.setattr(OpRunner, "start", lambda self: None)   # the op as it starts: nothing runs or moves
    with ctl_peer(loop) as ask:
        for i, (extra, want) in enumerate((({"merge": True}, "merge"), ({}, "split"))):
            reply = ask("SPLIT", i + 1, {"peer": "e2", "lo": 0, "hi": 0xFF, "throttle": 0, **extra}, sender="operator")
            assert reply.type == "OK", reply.body
            rec = loop.call(lambda: loop.op.rec)
            assert (rec.op, rec.source, rec.peer, rec.ranges) == (want, "e1", "e2", [[0, 0xFF]])
            assert schema.OpRec.from_json(rec.to_json()).op == want   # readable from etcd as written
            loop.call(lambda: setattr(loop, "op", None))


def test_the_loop_is_what_its_runner_and_housekeeper_may_ask_for(endpoint):
    """runner.py and housekeeper.py know the loop only by these interfaces (vid-lib/state/hosting.py): a member
    they use that the loop lost, or renamed, fails here, not in the middle of an operation."""
    from vfab.vid.state.hosting import HousekeepingHost, OperationHost

    loop = endpoint[0]
    assert isinstance(loop, OperationHost) and isinstance(loop, HousekeepingHost)
