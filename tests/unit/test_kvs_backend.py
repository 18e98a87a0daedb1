"""elastic-KVS as a loop backend: replies, records, retries, errors with the request's own ids, a full disk."""

from __future__ import annotations


import pytest

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.backend import KvsBackend
from vfab.services.elastic_kvs.proto import Op, Status
from vfab.services.elastic_kvs.store import Store, StoreError
from vfab.vid.ranges import Range
from vfab.vid.state.backend import BackendError, BadRequest, Refusal, Request

CLIENT = 0x1234_5678_9ABC


def req(op: Op, key: bytes, value: bytes = b"", reqid: int = 77) -> Request:
    payload = proto.Request(op, CLIENT, reqid, key, value).serialize()
    return Request(payload, proto.vkey(key), b"\x00" * 6)


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
    assert backend.counters["retries_recognised"] == 1


def test_deleting_a_deleted_or_missing_key_writes_nothing(backend):
    """A no-op delete leaves the write-ahead log as it was: its batch's commit has nothing to fsync (it
    cost a 1-client load one disk wait per such delete)."""
    backend.handle_batch([req(Op.PUT, b"k", b"v", reqid=1)])
    backend.handle_batch([req(Op.DEL, b"k", reqid=2)])
    wal = backend.store.path + "-wal"
    before = open(wal, "rb").read()   # its size says nothing: the store grows it ahead (grow_wal)
    replies, records = backend.handle_batch([req(Op.DEL, b"k", reqid=3), req(Op.DEL, b"ghost", reqid=4)])
    assert [proto.parse_reply(r).status for r in replies] == [Status.NOT_FOUND, Status.NOT_FOUND]
    assert records == [] and open(wal, "rb").read() == before
    backend.handle_batch([req(Op.PUT, b"k", b"again", reqid=5)])
    assert open(wal, "rb").read() != before          # a real write does reach it


def test_error_replies_carry_the_requests_own_ids(backend):
    bad = proto.REQ.pack(9, 0, 1, CLIENT, 4242) + b"k"        # unknown op, readable ids and key
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
