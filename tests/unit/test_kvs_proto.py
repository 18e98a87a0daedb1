"""services/elastic-kvs/proto.py: request/reply wire format, limits, the parser's error contract and vkey()."""

from __future__ import annotations

import random
import struct

import pytest

from vfab.services.elastic_kvs import proto
from vfab.services.elastic_kvs.proto import (
    MAX_KEY,
    MAX_VALUE,
    REP_LEN,
    REQ_LEN,
    KvsError,
    Op,
    Reply,
    Request,
    Status,
    check_key,
    check_value,
    parse_reply,
    parse_request,
    vkey,
)

CLIENT = 0x0123456789ABCDEF
U64_MAX = (1 << 64) - 1


def raw_request(op=2, flags=0, klen=None, client=CLIENT, reqid=1, key=b"k", value=b"", acked=0, deadline=0):
    """A request built by hand (bypassing Request.serialize's checks)."""
    if klen is None:
        klen = len(key)
    return struct.pack("!BBHQQQI", op, flags, klen, client, reqid, acked, deadline) + key + value


# -- layout -------------------------------------------------------------------


def test_header_sizes_match_the_documented_layout():
    assert REQ_LEN == 32
    assert REP_LEN == 28
    assert MAX_KEY == 128
    assert MAX_VALUE == 1280
    # header + the largest key + the largest value fit one vfab frame payload (1488 B)
    assert REQ_LEN + MAX_KEY + MAX_VALUE <= 1488


def test_serialized_request_bytes_are_exact():
    data = Request(Op.PUT, 0x0102030405060708, 0x1112131415161718, b"ab", b"xyz", 0x21, 0x31323334).serialize()
    head = bytes([2, 0, 0, 2, 1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]) + \
        (0x21).to_bytes(8, "big") + bytes([0x31, 0x32, 0x33, 0x34])
    assert data == head + b"abxyz"


def test_serialized_reply_bytes_are_exact():
    data = Reply(Status.NOT_FOUND, 0x0A0B, 7, b"hi", client=0x99).serialize()
    assert data == bytes([1, 0, 0, 0]) + (0x99).to_bytes(8, "big") + (0x0A0B).to_bytes(8, "big") + \
        (7).to_bytes(8, "big") + b"hi"


# -- round trips --------------------------------------------------------------


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("key", [b"k", b"\x00", bytes(range(MAX_KEY)), b"\xff" * MAX_KEY],
                         ids=["1", "nul", "max", "ff"])
def test_request_round_trip_keys(op, key):
    value = b"v" * 10 if op is Op.PUT else b""
    req = Request(op, CLIENT, 42, key, value)
    data = req.serialize()
    assert len(data) == REQ_LEN + len(key) + len(value)
    back = parse_request(data)
    assert back == req
    assert back.op is op
    assert back.key == key
    assert back.value == value


@pytest.mark.parametrize("size", [0, 1, MAX_VALUE - 1, MAX_VALUE])
def test_request_round_trip_values(size):
    value = random.Random(size).randbytes(size)
    req = Request(Op.PUT, CLIENT, 7, b"key", value)
    back = parse_request(req.serialize())
    assert back.value == value
    assert len(back.value) == size
    assert back == req


@pytest.mark.parametrize("client,reqid", [(0, 1), (U64_MAX, U64_MAX), (1, 1 << 63)])
def test_request_round_trip_id_extremes(client, reqid):
    req = Request(Op.GET, client, reqid, b"x")
    back = parse_request(req.serialize())
    assert (back.client, back.reqid) == (client, reqid)


def test_parse_request_accepts_bytearray_and_memoryview():
    data = Request(Op.PUT, CLIENT, 3, b"key", b"val").serialize()
    for form in (bytearray(data), memoryview(data)):
        back = parse_request(form)
        assert back == Request(Op.PUT, CLIENT, 3, b"key", b"val")
        assert type(back.key) is bytes and type(back.value) is bytes


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("body", [b"", b"x", b"\x00" * MAX_VALUE])
def test_reply_round_trip(status, body):
    rep = Reply(status, 99, 12345, body)
    data = rep.serialize()
    assert len(data) == REP_LEN + len(body)
    back = parse_reply(data)
    assert back == rep
    assert back.status is status


def test_reply_message_decodes_utf8_with_replacement():
    assert Reply(Status.BAD_REQUEST, 1, 0, "schlüssel".encode()).message == "schlüssel"
    assert Reply(Status.BAD_REQUEST, 1, 0, b"\xffok").message == "\ufffdok"


def test_error_reply_round_trip_and_truncation():
    back = parse_reply(proto.error_reply(5, Status.WRONG_OWNER, "not mine"))
    assert back == Reply(Status.WRONG_OWNER, 5, 0, b"not mine")
    long = proto.error_reply(6, Status.BAD_REQUEST, "x" * (MAX_VALUE + 500))
    back = parse_reply(long)
    assert len(back.body) == MAX_VALUE
    assert back.version == 0


def test_parse_reply_rejects_truncated_and_unknown_status():
    with pytest.raises(KvsError, match=r"truncated reply: 27 B, the header alone is 28 B"):
        parse_reply(b"\x00" * 27)
    with pytest.raises(KvsError, match=r"unknown reply status 2"):
        parse_reply(bytes([2]) + b"\x00" * 27)
    with pytest.raises(KvsError, match=r"unknown reply status 255"):
        parse_reply(b"\xff" + b"\x00" * 27)


# -- malformed requests -------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, REQ_LEN - 1])
def test_truncated_header(n):
    data = Request(Op.GET, CLIENT, 1, b"key").serialize()[:n]
    with pytest.raises(KvsError, match=rf"truncated request: {n} B, the header alone is {REQ_LEN} B"):
        parse_request(data)


@pytest.mark.parametrize("op", [0, 4, 0x7F, 0xFF])
def test_unknown_op(op):
    with pytest.raises(KvsError, match=rf"unknown op {op}: use GET \(1\), PUT \(2\) or DEL \(3\)"):
        parse_request(raw_request(op=op))


@pytest.mark.parametrize("flags", [1, 0x80, 0xFF])
def test_flags_set(flags):
    with pytest.raises(KvsError, match=rf"reserved flags {flags:#x} are set"):
        parse_request(raw_request(flags=flags))


@pytest.mark.parametrize("klen", [0, MAX_KEY + 1, 0xFFFF])
def test_key_length_out_of_bounds(klen):
    data = raw_request(klen=klen, key=b"k" * min(klen, 300))
    with pytest.raises(KvsError, match=rf"key length {klen} is out of bounds: keys are 1\.\.{MAX_KEY} B"):
        parse_request(data)


@pytest.mark.parametrize("klen,present", [(1, 0), (5, 4), (MAX_KEY, MAX_KEY - 1), (MAX_KEY, 0)])
def test_key_length_past_the_end(klen, present):
    data = raw_request(klen=klen, key=b"k" * present)
    with pytest.raises(KvsError, match=rf"truncated request: key length says {klen} B, {present} B follow"):
        parse_request(data)


def test_request_id_zero():
    with pytest.raises(KvsError, match=r"request id 0 is reserved"):
        parse_request(raw_request(reqid=0))


def test_acked_above_the_request_itself():
    assert parse_request(raw_request(reqid=5, acked=5, deadline=9)).acked == 5
    with pytest.raises(KvsError, match=r"acked 6 is above the request's own id 5"):
        parse_request(raw_request(reqid=5, acked=6))


@pytest.mark.parametrize("op", [Op.GET, Op.DEL])
@pytest.mark.parametrize("trailing", [1, 17])
def test_get_del_with_trailing_value(op, trailing):
    data = raw_request(op=int(op), key=b"key", value=b"v" * trailing)
    with pytest.raises(KvsError, match=rf"{op.name} carries no value, but {trailing} B follow the key"):
        parse_request(data)


@pytest.mark.parametrize("size", [MAX_VALUE + 1, MAX_VALUE + 100])
def test_oversized_value(size):
    data = raw_request(op=2, key=b"key", value=b"v" * size)
    with pytest.raises(KvsError, match=rf"value of {size} B is too large: the limit is {MAX_VALUE} B"):
        parse_request(data)


def test_serialize_refuses_what_parse_would_refuse():
    with pytest.raises(KvsError, match=r"key of 0 B is out of bounds"):
        Request(Op.GET, CLIENT, 1, b"").serialize()
    with pytest.raises(KvsError, match=rf"key of {MAX_KEY + 1} B is out of bounds: keys are 1\.\.{MAX_KEY} B"):
        Request(Op.GET, CLIENT, 1, b"k" * (MAX_KEY + 1)).serialize()
    with pytest.raises(KvsError, match=rf"value of {MAX_VALUE + 1} B is too large"):
        Request(Op.PUT, CLIENT, 1, b"k", b"v" * (MAX_VALUE + 1)).serialize()
    with pytest.raises(KvsError, match=r"GET carries no value"):
        Request(Op.GET, CLIENT, 1, b"k", b"v").serialize()
    with pytest.raises(KvsError, match=r"DEL carries no value"):
        Request(Op.DEL, CLIENT, 1, b"k", b"v").serialize()
    with pytest.raises(KvsError, match=r"key must be bytes, not str"):
        Request(Op.GET, CLIENT, 1, "k").serialize()


# -- fuzz ---------------------------------------------------------------------


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 and buf:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del buf[rng.randrange(len(buf) + 1):]
    elif kind == 2:  # extend
        buf += rng.randbytes(rng.randint(1, 1400))
    elif kind == 3:  # clobber the key length
        struct.pack_into("!H", buf, 2, rng.choice([0, 1, MAX_KEY, MAX_KEY + 1, rng.randrange(65536)]))
    elif kind == 4:  # clobber op / flags / reqid
        buf[0] = rng.choice([0, 1, 2, 3, 4, 255])
        buf[1] = rng.choice([0, 0, 1, 128])
        struct.pack_into("!Q", buf, 12, rng.choice([0, 1, U64_MAX]))
    else:  # splice a random slice out
        a = rng.randrange(len(buf) + 1)
        b = rng.randrange(a, len(buf) + 1)
        del buf[a:b]
    return bytes(buf)


def test_fuzz_parse_request_raises_only_kvs_error():
    rng = random.Random(0xC0FFEE)
    outcomes = {"ok": 0, "kvs": 0}
    for i in range(20_000):
        if i % 2:
            op = rng.choice(list(Op))
            key = rng.randbytes(rng.randint(1, MAX_KEY))
            value = rng.randbytes(rng.randint(0, MAX_VALUE)) if op is Op.PUT else b""
            reqid = rng.randint(1, U64_MAX)
            data = _mutate(rng, Request(op, rng.getrandbits(64), reqid, key, value, rng.randint(0, reqid),
                                        rng.getrandbits(32)).serialize())
        else:
            data = rng.randbytes(rng.choice([rng.randint(0, 40), rng.randint(0, 1600)]))
        try:
            req = parse_request(data)
        except KvsError as exc:
            assert str(exc), f"empty KvsError message for input {data[:40].hex()}"
            outcomes["kvs"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"parse_request raised {type(exc).__name__}: {exc} "
                        f"for input {data[:60].hex()} (len {len(data)})")
        else:
            outcomes["ok"] += 1
            # whatever parses is well-formed and serializes back to the same bytes
            assert 1 <= len(req.key) <= MAX_KEY
            assert len(req.value) <= MAX_VALUE
            assert req.reqid >= 1
            assert req.op is Op.PUT or req.value == b""
            assert req.serialize() == data
    # the corpus exercised both paths
    assert outcomes["ok"] > 500
    assert outcomes["kvs"] > 5000


# -- check_key / check_value ----------------------------------------------------


@pytest.mark.parametrize("key", [b"a", b"k" * MAX_KEY, bytearray(b"xy")])
def test_check_key_accepts(key):
    out = check_key(key)
    assert out == bytes(key)
    assert type(out) is bytes


@pytest.mark.parametrize("n", [0, MAX_KEY + 1, 4096])
def test_check_key_length_limit_message(n):
    with pytest.raises(KvsError) as ei:
        check_key(b"k" * n)
    msg = str(ei.value)
    assert f"key of {n} B is out of bounds" in msg
    assert str(MAX_KEY) in msg
    assert msg.endswith(f"keys are 1..{MAX_KEY} B")


@pytest.mark.parametrize("bad,name", [("key", "str"), (5, "int"), (None, "NoneType"),
                                      (memoryview(b"k"), "memoryview")])
def test_check_key_type(bad, name):
    with pytest.raises(KvsError, match=rf"key must be bytes, not {name}"):
        check_key(bad)


@pytest.mark.parametrize("value", [b"", b"v", b"v" * MAX_VALUE, bytearray(3)])
def test_check_value_accepts(value):
    out = check_value(value)
    assert out == bytes(value)
    assert type(out) is bytes


@pytest.mark.parametrize("n", [MAX_VALUE + 1, 10 * MAX_VALUE])
def test_check_value_limit_message(n):
    with pytest.raises(KvsError) as ei:
        check_value(b"v" * n)
    msg = str(ei.value)
    assert f"value of {n} B is too large" in msg
    assert f"the limit is {MAX_VALUE} B" in msg


@pytest.mark.parametrize("bad,name", [("v", "str"), (1, "int"), ([1], "list")])
def test_check_value_type(bad, name):
    with pytest.raises(KvsError, match=rf"value must be bytes, not {name}"):
        check_value(bad)


def test_kvs_error_is_a_vfab_error():
    from vfab.vid.errors import VfabError

    assert issubclass(KvsError, VfabError)


# -- vkey -----------------------------------------------------------------------


def test_vkey_known_values_and_determinism():
    import hashlib

    for key in (b"a", b"user:1", b"\x00" * MAX_KEY):
        expected = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()[:3], "big")
        assert vkey(key) == expected
        assert vkey(key) == vkey(bytes(key))
    assert vkey(b"a") != vkey(b"b")


def test_vkey_remembers_keys_up_to_its_bound_and_takes_any_bytes_like(monkeypatch):
    import hashlib

    monkeypatch.setattr(proto, "VKEYS_MAX", 4)
    monkeypatch.setattr(proto, "_vkeys", {})
    keys = [f"k{i}".encode() for i in range(10)]
    for key in keys + keys:
        assert vkey(key) == int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()[:3], "big")
        assert len(proto._vkeys) <= 4
    assert vkey(bytearray(b"k1")) == vkey(memoryview(b"k1")) == vkey(b"k1")
    assert all(type(k) is bytes for k in proto._vkeys)


def test_pack_request_is_what_serialize_sends():
    for op, key, value in ((Op.GET, b"a", b""), (Op.PUT, b"k" * MAX_KEY, b"v" * MAX_VALUE), (Op.DEL, b"\x00", b"")):
        assert proto.pack_request(op, CLIENT, 5, key, value) == Request(op, CLIENT, 5, key, value).serialize()


def test_vkey_is_24_bit_and_uses_the_whole_width():
    vks = [vkey(f"key-{i}".encode()) for i in range(10_000)]
    assert all(isinstance(v, int) and 0 <= v < (1 << 24) for v in vks)
    # the top byte is used (not a narrower hash): some keys land in the upper half
    assert max(vks) >= 1 << 23
    assert len(set(vks)) > 9_990  # 10k keys in 16M slots: only a handful of collisions


def test_vkey_spreads_keys_evenly_over_16_buckets():
    counts = [0] * 16
    n = 10_000
    for i in range(n):
        counts[vkey(f"key-{i}".encode()) >> 20] += 1
    mean = n / 16
    assert sum(counts) == n
    for b, c in enumerate(counts):
        assert 0.7 * mean <= c <= 1.3 * mean, f"bucket {b} holds {c} keys, mean {mean}: {counts}"
