"""elastic-KVS as a loop backend: replies, records, exactly-once writes, errors with the request's own ids, a full
disk."""

from __future__ import annotations

import time

import pytest

from vfab.services.elastic_kvs import proto, session
from vfab.services.elastic_kvs.backend import KvsBackend
from vfab.services.elastic_kvs.proto import Op, Status
from vfab.services.elastic_kvs.store import Store, StoreError
from vfab.vid.ranges import Range
from vfab.vid.state.backend import BackendError, BadRequest, Refusal, Request

CLIENT = 0x1234_5678_9ABC
OTHER = 0x4444


def req(op: Op, key: bytes, value: bytes = b"", reqid: int = 77, client: int = CLIENT, acked: int = 0,
        deadline: float | None = None) -> Request:
    deadline = int(time.time()) + 30 if deadline is None else int(deadline)
    payload = proto.Request(op, client, reqid, key, value, acked, deadline).serialize()
    return Request(payload, proto.vkey(key), b"\x00" * 6)


def reply(replies: list, i: int = 0) -> proto.Reply:
    return proto.parse_reply(replies[i])


@pytest.fixture
def backend(tmp_path):
    b = KvsBackend(Store(str(tmp_path / "s.sqlite")))
    yield b
    b.store.close()


def test_write_returns_its_record_and_a_reply_with_the_clients_ids(backend):
    replies, records = backend.handle_batch([req(Op.PUT, b"k", b"v", reqid=0xDEAD_BEEF_0000_0001)])
    rep = proto.parse_reply(replies[0])
    assert (rep.status, rep.client, rep.reqid, rep.version) == (Status.OK, CLIENT, 0xDEAD_BEEF_0000_0001, 1)
    assert records == [(proto.vkey(b"k"), backend.store.record(b"k"))]


def test_a_recognised_retry_still_returns_the_record_for_the_mirrors(backend):
    """The first reply may never have left (a mirror failed): the retry must replicate again."""
    backend.handle_batch([req(Op.PUT, b"k", b"v", reqid=5)])
    replies, records = backend.handle_batch([req(Op.PUT, b"k", b"v", reqid=5)])
    assert proto.parse_reply(replies[0]).version == 1          # applied once
    assert records == [(proto.vkey(b"k"), backend.store.record(b"k"))]
    assert backend.counters["answered_from_record"] == 1


def test_a_late_copy_of_a_write_is_answered_from_its_record_after_any_number_of_later_writes(backend):
    """Issue 42: a PUT acknowledged, then many more acknowledged writes of the key (the old memory kept 16
    request ids), then a copy of the first PUT (a retry, or one a stopped owner held and forwards): it is
    answered with its first reply and the key keeps the newest value."""
    assert reply(backend.handle_batch([req(Op.PUT, b"hot", b"first", reqid=1)])[0]).version == 1
    for i in range(40):
        backend.handle_batch([req(Op.PUT, b"hot", b"w%d" % i, reqid=100 + i, client=OTHER, acked=100 + i)])
    replies, records = backend.handle_batch([req(Op.PUT, b"hot", b"first", reqid=1)])
    assert (reply(replies).status, reply(replies).version) == (Status.OK, 1)
    assert backend.store.row(b"hot")[:2] == (b"w39", 41)
    assert records == [(proto.vkey(b"hot"), backend.store.record(b"hot"))]   # re-sent to the mirrors
    # OTHER's own records were dropped as it acknowledged them: its entry holds its newest one only
    assert session.parse(backend.store.row(b"hot")[2])[OTHER].records == {139: 41}


def test_a_copy_the_client_has_acknowledged_is_dropped_unanswered_and_not_applied(backend):
    backend.handle_batch([req(Op.PUT, b"k", b"old", reqid=1)])
    backend.handle_batch([req(Op.PUT, b"k", b"new", reqid=2, acked=2)])   # the client has 1's answer
    replies, records = backend.handle_batch([req(Op.PUT, b"k", b"old", reqid=1)])
    assert replies == [None] and records == []
    assert backend.store.row(b"k")[:2] == (b"new", 2)
    assert backend.counters["stale_dropped"] == 1


def test_a_delete_of_a_missing_key_leaves_its_record(backend):
    """A late copy of it must not delete what another client put after it was answered."""
    replies, records = backend.handle_batch([req(Op.DEL, b"ghost", reqid=3)])
    assert (reply(replies).status, reply(replies).version) == (Status.NOT_FOUND, 1) and len(records) == 1
    backend.handle_batch([req(Op.PUT, b"ghost", b"boo", reqid=9, client=OTHER)])
    replies, _ = backend.handle_batch([req(Op.DEL, b"ghost", reqid=3)])
    assert (reply(replies).status, reply(replies).version) == (Status.NOT_FOUND, 1)
    assert backend.store.row(b"ghost")[:2] == (b"boo", 2)


def test_only_a_batch_that_changed_data_waits_for_the_disk(backend, monkeypatch):
    """A DELETE that found nothing leaves only its completion record: committed, not synced on its own (the
    next write's sync covers it); a batch that changed data is synced before its replies are returned."""
    syncs = []
    monkeypatch.setattr(backend.store, "sync", lambda: syncs.append(1))
    backend.handle_batch([req(Op.DEL, b"ghost", reqid=1), req(Op.GET, b"ghost", reqid=2)])
    assert syncs == [] and session.lookup(backend.store.row(b"ghost")[2], CLIENT, 1)[0] == session.DONE
    backend.handle_batch([req(Op.DEL, b"ghost", reqid=3), req(Op.PUT, b"k", b"v", reqid=4)])
    assert syncs == [1]
    backend.handle_batch([req(Op.DEL, b"k", reqid=5)])          # a delete that deletes
    assert syncs == [1, 1]


def test_a_request_past_its_deadline_is_refused_and_not_applied(backend):
    replies, records = backend.handle_batch([req(Op.PUT, b"k", b"late", reqid=1, deadline=time.time() - 2)])
    assert reply(replies).status is Status.EXPIRED and "deadline" in reply(replies).message and records == []
    assert backend.store.row(b"k") is None
    replies, _ = backend.handle_batch([req(Op.PUT, b"k", b"far", reqid=2, deadline=time.time() + 3600)])
    assert reply(replies).status is Status.BAD_REQUEST and "check the client's clock" in reply(replies).message
    assert backend.store.row(b"k") is None


def test_a_retry_after_the_key_moved_is_answered_from_the_record_that_moved_with_it(backend, tmp_path):
    """The records travel in the key's state record: a copy (split, merge, move) or a mirror's replication
    carries them, and the new owner answers a retry of a write the old owner acknowledged."""
    replies, records = backend.handle_batch([req(Op.PUT, b"k", b"v1", reqid=1)])
    target = KvsBackend(Store(str(tmp_path / "t.sqlite")))
    try:
        target.apply([blob for blob, _ in backend.snapshot(Range(0, 0xFFFFFF), 1 << 20)], gen=target.begin_copy())
        for i in range(20):
            target.handle_batch([req(Op.PUT, b"k", b"o%d" % i, reqid=10 + i, client=OTHER)])
        again, _ = target.handle_batch([req(Op.PUT, b"k", b"v1", reqid=1)])
        assert reply(again).version == 1 and target.store.row(b"k")[:2] == (b"o19", 21)
        # and one replicated to a mirror record by record
        mirror = KvsBackend(Store(str(tmp_path / "m.sqlite")))
        try:
            mirror.apply([blob for _, blob in records])
            assert reply(mirror.handle_batch([req(Op.PUT, b"k", b"v1", reqid=1)])[0]).version == 1
        finally:
            mirror.store.close()
    finally:
        target.store.close()


def test_error_replies_carry_the_requests_own_ids(backend):
    bad = proto.REQ.pack(9, 0, 1, CLIENT, 4242, 0, 0) + b"k"        # unknown op, readable ids and key
    replies, records = backend.handle_batch([Request(bad, proto.vkey(b"k"), b"")])
    rep = proto.parse_reply(replies[0])
    assert (rep.status, rep.client, rep.reqid) == (Status.BAD_REQUEST, CLIENT, 4242) and records == []
    err = proto.parse_reply(backend.error_reply(bad, Refusal.UNAVAILABLE, "disk"))
    assert (err.status, err.client, err.reqid, err.message) == (Status.UNAVAILABLE, CLIENT, 4242, "disk")
    with pytest.raises(BadRequest, match="no readable key"):
        backend.key_of(b"\x01\x00")


def test_a_full_disk_is_named_and_nothing_is_half_applied(small_disk):
    store = Store(str(small_disk / "s.sqlite"))
    backend = KvsBackend(store)
    try:
        with pytest.raises(BackendError) as err:
            for i in range(10_000):
                backend.handle_batch([req(Op.PUT, f"k{i}-{j}".encode(), b"x" * 1000, reqid=i * 64 + j + 1)
                                      for j in range(8)])
        text = str(err.value)
        assert "database or disk is full" in text and "free space" in text, text
        assert "cannot rollback" not in text
        n = store.count(Range(0, 0xFFFFFF))
        assert n % 8 == 0                                      # whole batches only
        # A bulk copy into a full store fails the same clear way.
        blob = b"".join(store.record(f"k{i}-0".encode()).replace(b"k", b"z", 1) for i in range(3))
        with pytest.raises(StoreError, match="full"):
            for _ in range(2000):
                backend.apply([blob * 50], durable=False)
    finally:
        store.close()
