"""vid-lib/envelope.py: the ZeroMQ control envelope (header JSON + blobs)."""

from __future__ import annotations

import json

import pytest

from vfab.vid.envelope import MAX_HEADER, VERSION, Envelope, EnvelopeError, decode
from vfab.vid.errors import VfabError


def header(**fields) -> bytes:
    head = {"v": VERSION, "type": "PING"}
    head.update(fields)
    return json.dumps(head).encode()


# -- round trips --------------------------------------------------------------------


def test_frames_layout():
    env = Envelope("CHUNK", sender="kvs-1", epoch=3, id=9, body={"range": "0-15", "n": 2}, blobs=[b"a", b"bc"])
    frames = env.frames()
    assert len(frames) == 3
    assert json.loads(frames[0]) == {"v": 1, "type": "CHUNK", "sender": "kvs-1", "epoch": 3, "id": 9,
                                     "body": {"range": "0-15", "n": 2}}
    assert b" " not in frames[0]  # compact separators
    assert frames[1:] == [b"a", b"bc"]


@pytest.mark.parametrize("blobs", [[], [b""], [b"\x00\xff" * 1000], [b"x", b"", bytes(range(256))]])
def test_round_trip_with_blobs(blobs):
    env = Envelope("REPL", sender="a", epoch=12, id=345, body={"keys": [1, 2], "nested": {"ok": True}}, blobs=blobs)
    back = decode(env.frames())
    assert back == env
    assert back.blobs == blobs
    assert all(type(b) is bytes for b in back.blobs)


def test_round_trip_defaults_and_unicode():
    assert decode(Envelope("OK").frames()) == Envelope("OK", "", 0, 0, {}, [])
    env = Envelope("ERR", sender="knoten-ü", body={"message": "schlüssel ✓"})
    assert decode(env.frames()) == env


def test_decode_accepts_bytearray_and_memoryview_frames():
    frames = Envelope("FWD", epoch=1, id=2, blobs=[b"raw frame"]).frames()
    back = decode([bytearray(frames[0]), memoryview(frames[1])])
    assert back == Envelope("FWD", epoch=1, id=2, blobs=[b"raw frame"])
    assert type(back.blobs[0]) is bytes


def test_decode_ignores_unknown_header_fields_and_fills_defaults():
    back = decode([header(extra="x", future={"a": 1}, body={"k": 1})])
    assert back == Envelope("PING", "", 0, 0, {"k": 1}, [])


def test_decode_large_but_allowed_header():
    body = {"pad": "x" * (MAX_HEADER - 200)}
    frames = Envelope("STATS", body=body).frames()
    assert len(frames[0]) <= MAX_HEADER
    assert decode(frames).body == body


# -- errors ------------------------------------------------------------------------------


def test_envelope_error_is_a_vfab_error():
    assert issubclass(EnvelopeError, VfabError)


def test_empty_list():
    with pytest.raises(EnvelopeError, match=r"empty control message: a header frame is required"):
        decode([])


@pytest.mark.parametrize("v", [0, 2, 99, "1", None])
def test_wrong_version_names_both(v):
    with pytest.raises(EnvelopeError) as ei:
        decode([header(v=v)])
    msg = str(ei.value)
    assert f"control message version {v!r} is not supported" in msg
    assert f"this endpoint speaks {VERSION}" in msg


def test_missing_version():
    with pytest.raises(EnvelopeError, match=r"version None is not supported"):
        decode([json.dumps({"type": "PING"}).encode()])


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"{'v': 1}", b"\x80\x81", b"\xff\xfe\x00"])
def test_non_json(raw):
    with pytest.raises(EnvelopeError, match=r"^control header is not JSON: "):
        decode([raw])


@pytest.mark.parametrize("raw", [b"[]", b"[1, 2]", b"1", b'"PING"', b"null", b"true"])
def test_non_object(raw):
    with pytest.raises(EnvelopeError, match=r"^control header is not a JSON object$"):
        decode([raw])


@pytest.mark.parametrize("head", [
    {"v": 1},
    {"v": 1, "type": None},
    {"v": 1, "type": 5},
    {"v": 1, "type": ["PING"]},
    {"v": 1, "type": "PING", "body": []},
    {"v": 1, "type": "PING", "body": "x"},
    {"v": 1, "type": "PING", "body": None},
], ids=["missing-type", "null-type", "int-type", "list-type", "list-body", "str-body", "null-body"])
def test_missing_or_bad_type_or_body(head):
    with pytest.raises(EnvelopeError, match=r"control header needs a string 'type' and an object 'body'"):
        decode([json.dumps(head).encode()])


@pytest.mark.parametrize("field", ["epoch", "id"])
@pytest.mark.parametrize("bad", ["abc", None, [], {}, [1], ""])
def test_non_integer_epoch_or_id(field, bad):
    with pytest.raises(EnvelopeError, match=r"control header has a non-integer 'epoch' or 'id'"):
        decode([header(**{field: bad})])


@pytest.mark.parametrize("field", ["epoch", "id"])
@pytest.mark.parametrize("raw_value", ["Infinity", "-Infinity", "1e400"])
def test_infinite_epoch_or_id_is_an_envelope_error(field, raw_value):
    raw = b'{"v":1,"type":"PING","%s":%s}' % (field.encode(), raw_value.encode())
    with pytest.raises(EnvelopeError, match=r"non-integer"):
        decode([raw])


@pytest.mark.parametrize("raw_value", ["1.5", '"7"', "true"])
def test_non_integer_epoch_is_not_coerced(raw_value):
    with pytest.raises(EnvelopeError, match=r"non-integer"):
        decode([b'{"v":1,"type":"PING","epoch":%s}' % raw_value.encode()])


def test_deeply_nested_header_is_an_envelope_error():
    raw = b'{"v":1,"type":"PING","body":{"x":' + b"[" * 20000 + b"]" * 20000 + b"}}"
    assert len(raw) <= MAX_HEADER
    with pytest.raises(EnvelopeError):
        decode([raw])


@pytest.mark.parametrize("extra", [1, 1000])
def test_oversized_header(extra):
    raw = b" " * (MAX_HEADER + extra - 2) + b"{}"
    assert len(raw) == MAX_HEADER + extra
    with pytest.raises(EnvelopeError) as ei:
        decode([raw])
    msg = str(ei.value)
    assert f"control header of {MAX_HEADER + extra} B is too large" in msg
    assert f"the limit is {MAX_HEADER} B" in msg


def test_oversized_header_from_frames():
    frames = Envelope("CHUNK", body={"pad": "x" * MAX_HEADER}).frames()
    with pytest.raises(EnvelopeError, match=r"is too large: the limit is 65536 B"):
        decode(frames)


def test_header_of_exactly_max_header_is_accepted():
    raw = header()
    raw = raw[:-1] + b" " * (MAX_HEADER - len(raw)) + b"}"
    assert len(raw) == MAX_HEADER
    assert decode([raw]).type == "PING"


# -- reply ---------------------------------------------------------------------------------


def test_reply_keeps_id_and_epoch():
    req = Envelope("SPLIT", sender="operator", epoch=41, id=77, body={"range": "0-99"}, blobs=[b"x"])
    rep = req.reply(sender="kvs-2", moved=12)
    assert (rep.type, rep.sender, rep.epoch, rep.id) == ("OK", "kvs-2", 41, 77)
    assert rep.body == {"moved": 12}
    assert rep.blobs == []
    err = req.reply("ERR", message="no")
    assert (err.type, err.sender, err.epoch, err.id, err.body) == ("ERR", "", 41, 77, {"message": "no"})
    # the request is untouched, and the reply survives the wire
    assert req.body == {"range": "0-99"} and req.blobs == [b"x"]
    assert decode(rep.frames()) == rep


def test_default_containers_are_not_shared():
    a, b = Envelope("OK"), Envelope("OK")
    a.body["x"] = 1
    a.blobs.append(b"y")
    assert b.body == {} and b.blobs == []
