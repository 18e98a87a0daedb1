"""vid-lib/frame.py: the vfab frame on the wire."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vfab.vid import codec, frame
from vfab.vid.errors import FrameError
from vfab.vid.frame import ETH_TYPE, HDR_LEN, MAX_PAYLOAD, MIN_LEN, Frame, FrameType, parse

DST = codec.encode(7, 42).packed
SRC = bytes.fromhex("020000000001")

macs = st.binary(min_size=6, max_size=6)
frames = st.builds(
    Frame, dst=macs, src=macs, type=st.sampled_from(list(FrameType)),
    payload=st.binary(max_size=MAX_PAYLOAD), channel=st.integers(0, 0xFFFF),
    seq=st.integers(0, 0xFFFFFFFF), ack=st.none() | st.integers(0, 0xFFFFFFFF),
    priority=st.integers(0, 7),
)


def raw(version=1, ftype=1, flags=0, reserved=0, channel=0, length=None, seq=0, ack=0,
        payload=b"", eth_type=ETH_TYPE):
    length = len(payload) if length is None else length
    return (struct.pack("!6s6sH", DST, SRC, eth_type)
            + struct.pack("!BBBBHHII", version, ftype, flags, reserved, channel, length, seq, ack)
            + payload)


@given(frames)
def test_round_trip(f):
    data = f.serialize()
    assert len(data) == MIN_LEN + len(f.payload)
    assert parse(data) == f
    assert parse(bytearray(data)) == f
    assert parse(memoryview(data)) == f


def test_layout_on_the_wire():
    f = Frame(DST, SRC, FrameType.REPLY, b"hi", channel=0x0102, seq=0x03040506, ack=7, priority=5)
    data = f.serialize()
    assert data[:6] == DST and data[6:12] == SRC and data[12:14] == b"\x88\xb5"
    assert data[14:18] == bytes([1, 2, 5 | frame.FLAG_ACK, 0])
    assert data[18:22] == b"\x01\x02\x00\x02"
    assert data[22:30] == bytes.fromhex("0304050600000007")
    assert data[30:] == b"hi"
    assert MIN_LEN == 14 + HDR_LEN == 30


def test_ack_absent_vs_zero():
    assert parse(Frame(DST, SRC, FrameType.ACK, ack=0).serialize()).ack == 0
    assert parse(Frame(DST, SRC, FrameType.ACK).serialize()).ack is None
    # An ack number without the ACK flag is not an ack.
    assert parse(raw(ack=99)).ack is None


@given(frames, st.binary(min_size=1, max_size=64))
def test_ethernet_padding_is_ignored(f, pad):
    assert parse(f.serialize() + pad) == f


def test_min_ethernet_frame_padding():
    data = Frame(DST, SRC, FrameType.REQUEST, b"x").serialize()
    padded = data + bytes(60 - len(data))
    assert len(padded) == 60 and parse(padded).payload == b"x"


# -- errors say what is wrong -------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 13, 14, MIN_LEN - 1])
def test_truncated(n):
    with pytest.raises(FrameError, match=f"truncated frame: {n} B.*at least {MIN_LEN} B"):
        parse(raw(payload=b"abc")[:n])


def test_truncated_payload_is_wrong_length():
    data = raw(payload=b"abcdef")
    with pytest.raises(FrameError, match="wrong length: header says 6 B of payload, frame carries 3 B"):
        parse(data[:-3])
    with pytest.raises(FrameError, match="header says 100 B"):
        parse(raw(length=100, payload=b"abc"))


def test_wrong_version():
    with pytest.raises(FrameError, match="unsupported vfab version 2: this receiver speaks 1"):
        parse(raw(version=2))
    with pytest.raises(FrameError, match="version 0"):
        parse(raw(version=0))


@pytest.mark.parametrize("flags, reserved", [(0x10, 0), (0x80, 0), (0xF7, 0), (0, 1), (0, 0xFF)])
def test_reserved_bits(flags, reserved):
    with pytest.raises(FrameError, match="reserved header bits are set"):
        parse(raw(flags=flags, reserved=reserved))


@pytest.mark.parametrize("ftype", [0, 5, 255])
def test_unknown_type(ftype):
    with pytest.raises(FrameError, match=f"unknown frame type {ftype}"):
        parse(raw(ftype=ftype))


@pytest.mark.parametrize("eth_type, shown", [(0x0800, "0x0800"), (0x86DD, "0x86dd"), (0x88B6, "0x88b6")])
def test_not_vfab_ethertype(eth_type, shown):
    with pytest.raises(FrameError, match=f"not a vfab frame: EtherType {shown}, expected 0x88b5"):
        parse(raw(eth_type=eth_type))


def test_serialize_errors():
    with pytest.raises(FrameError, match=f"payload of {MAX_PAYLOAD + 1} B is too large.*limit is {MAX_PAYLOAD} B"):
        Frame(DST, SRC, FrameType.REQUEST, bytes(MAX_PAYLOAD + 1)).serialize()
    Frame(DST, SRC, FrameType.REQUEST, bytes(MAX_PAYLOAD)).serialize()
    for prio in (-1, 8):
        with pytest.raises(FrameError, match=f"priority {prio} is out of range: use 0..7"):
            Frame(DST, SRC, FrameType.REQUEST, priority=prio).serialize()


@given(frames)
def test_pack_is_what_serialize_sends(f):
    assert frame.pack(f.dst, f.src, f.type, f.payload, f.channel, f.seq, f.priority, f.ack) == f.serialize()


def test_pack_checks_the_payload_and_the_priority():
    with pytest.raises(FrameError, match=f"payload of {MAX_PAYLOAD + 1} B is too large"):
        frame.pack(DST, SRC, FrameType.REQUEST, bytes(MAX_PAYLOAD + 1))
    with pytest.raises(FrameError, match="priority 8 is out of range"):
        frame.pack(DST, SRC, FrameType.REQUEST, b"", priority=8)
    assert parse(frame.pack(DST, SRC, FrameType.REQUEST, bytearray(b"x"), 3, 9)) == \
        Frame(DST, SRC, FrameType.REQUEST, b"x", channel=3, seq=9)


@pytest.mark.parametrize("field", ["dst", "src"])
@pytest.mark.parametrize("mac", [b"\x0e\x01", bytes(7), b""])
def test_serialize_rejects_mac_of_wrong_size(field, mac):
    # Regression: struct "6s" silently padded/truncated such MACs.
    kwargs = {"dst": DST, "src": SRC, field: mac}
    with pytest.raises(FrameError, match=f"{field} MAC .* is not 6 packed bytes"):
        Frame(type=FrameType.REQUEST, **kwargs).serialize()


def test_frame_error_is_a_value_error():
    assert issubclass(FrameError, ValueError)


# -- fuzz -------------------------------------------------------------------------------
def _check(data: bytes) -> str:
    try:
        f = parse(data)
    except FrameError as exc:
        assert str(exc)
        return "error"
    assert isinstance(f.type, FrameType) and len(f.dst) == 6 and len(f.src) == 6
    assert 0 <= f.priority <= 7
    assert parse(f.serialize()) == f if len(f.payload) <= MAX_PAYLOAD else True
    return "ok"


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and buf:  # flip bits
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # random byte
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 2:  # truncate
            del buf[rng.randrange(len(buf) + 1):]
        elif op == 3:  # extend
            buf += rng.randbytes(rng.randrange(40))
        else:  # poke the header (version/type/flags/reserved/length) specifically
            i = rng.randrange(14, MIN_LEN)
            if i < len(buf):
                buf[i] = rng.choice([0, 1, 2, 3, 4, 5, 0x0F, 0x10, 0x7F, 0xFF])
    return bytes(buf)


def test_fuzz_parse_raises_only_frame_error():
    rng = random.Random(0x88B5)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(10_000):  # random strings, half of them with the vfab EtherType
        data = bytearray(rng.randbytes(rng.randrange(0, 80)))
        if len(data) >= 14 and rng.random() < 0.5:
            data[12:14] = b"\x88\xb5"
            if len(data) > 14 and rng.random() < 0.5:
                data[14] = 1
        outcomes[_check(bytes(data))] += 1
    seeds = [
        Frame(DST, SRC, t, rng.randbytes(rng.randrange(0, 64)), channel=rng.randrange(1 << 16),
              seq=rng.randrange(1 << 32), ack=rng.choice([None, rng.randrange(1 << 32)]),
              priority=rng.randrange(8)).serialize()
        for t in FrameType for _ in range(5)
    ]
    for _ in range(10_000):  # mutations of valid frames
        outcomes[_check(_mutate(rng, rng.choice(seeds)))] += 1
    assert outcomes["ok"] > 500 and outcomes["error"] > 500, outcomes
