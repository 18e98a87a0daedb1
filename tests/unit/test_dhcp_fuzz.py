"""Fuzzing a shard's whole receive path with hostile DHCP frames (issue 9, "Bad input"), no network.

``test_dhcp_wire.py`` already fuzzes ``wire.parse`` and ``ipudp.parse`` on their own
(random option soups and byte mutations: only ``DhcpError``, and round trips), and
``test_sdhcp_backend.py`` mutates one request's bytes in front of ``key_of``.  This
file drives *Ethernet frames* down the path a shard runs (``SdhcpLoop._handle``)::

    frames.wrap (ipudp.parse, UDP ports, size)  -- DhcpError  -> the loop counts bad_frames
    vid frame.parse of the wrapped frame
    backend.key_of (wire.parse, op, htype/hlen, message type, chaddr = source, relay)
                                               -- BadRequest -> one backend counter
    backend.handle_batch                       -- served (or silence), never an exception

with a seeded generator of attacks, one family at a time: truncations (of the
frame and of the DHCP message), wrong op, bad and overrunning options, unknown
and server message types, option overload (52) pointing at garbage or at a loop,
bad overload values, hlen/htype lies, chaddr not the frame's source, relayed
frames from an untrusted giaddr, oversize frames, bad checksums, fragments,
wrong ports, plus random mutations and random bytes.  Every frame must end in
exactly one of: refused by the wrap, refused by ``key_of`` with exactly one
counter raised by one, or served; the families that must be refused must land in
the counter that names their fault.  :func:`bad_frames` (only frames that must be
refused) is also the burst ``tests/integration/test_sdhcp_failover.py`` sends to a
live shard.
"""

from __future__ import annotations

import collections
import random
from ipaddress import IPv4Address

import pytest

from vfab.services.sdhcp import frames, ipudp
from vfab.services.sdhcp.backend import SdhcpBackend
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.store import Store
from vfab.services.sdhcp.wire import END, FILE_OFF, MIN_LEN, SNAME_OFF, Message, MessageType, Opt
from vfab.vid.frame import FrameType
from vfab.vid.frame import parse as parse_vfab
from vfab.vid.ranges import FULL
from vfab.vid.state.backend import BadRequest, Request

SERVER = IPv4Address("192.168.77.1")
OPTS = {"pool": "192.168.77.10-192.168.77.250", "mask": "24", "server": str(SERVER), "lease": "600",
        "relays": "192.168.9.1"}
MAC = bytes.fromhex("025d00200001")
PORT_MAC = bytes.fromhex("0a0000000001")
BCAST = b"\xff" * 6
UDP_OFF = 14 + 20 + 8          # where the DHCP message starts in the frames built here
N = 6000


def dhcp(rnd: random.Random, mac: bytes = MAC, mtype: MessageType | None = None, **kw) -> Message:
    mtype = mtype or rnd.choice([MessageType.DISCOVER, MessageType.REQUEST, MessageType.INFORM,
                                 MessageType.RELEASE, MessageType.DECLINE])
    opts = {Opt.MSG_TYPE: bytes([mtype])}
    if rnd.random() < 0.5:
        opts[Opt.REQUESTED_IP] = IPv4Address(f"192.168.77.{rnd.randrange(256)}").packed
    if rnd.random() < 0.5:
        opts[Opt.CLIENT_ID] = b"\x01" + mac
    if rnd.random() < 0.3:
        opts[Opt.PARAM_REQUEST_LIST] = bytes(rnd.randrange(1, 255) for _ in range(rnd.randrange(1, 30)))
    return Message(op=kw.pop("op", 1), xid=rnd.getrandbits(32), chaddr=mac, options=opts, **kw)


def udp(payload: bytes, src: bytes = MAC, sport: int = 68, dport: int = 67) -> bytes:
    return ipudp.Datagram(BCAST, src, IPv4Address(0), IPv4Address("255.255.255.255"), sport, dport,
                          payload).serialize()


def opts_end(data: bytes) -> int:
    """Offset of the options field's end option in a serialized message."""
    i = MIN_LEN
    while data[i] != END:
        i += 1 if data[i] == 0 else 2 + data[i + 1]
    return i


def with_options(rnd: random.Random, raw_options: bytes, *, file: bytes = b"", sname: bytes = b"") -> bytes:
    """A message whose options field is exactly ``raw_options`` (no end added) and whose file/sname hold
    the given bytes."""
    base = bytearray(dhcp(rnd, mtype=MessageType.DISCOVER).serialize()[:MIN_LEN])
    base[FILE_OFF:FILE_OFF + len(file)] = file
    base[SNAME_OFF:SNAME_OFF + len(sname)] = sname
    return bytes(base) + raw_options


def garbage(rnd: random.Random, n: int) -> bytes:
    """Bytes without an end option (255): a field that can never parse."""
    return bytes(rnd.randrange(255) for _ in range(n))


MT = bytes([Opt.MSG_TYPE, 1, MessageType.DISCOVER])


# Each family: (generator(rnd, mac) -> frame, the outcomes it may have).  An outcome is "wrap" (refused
# before the backend: the loop's bad_frames), a backend counter name (key_of refused it), or "served".
def _truncated_frame(rnd, mac):
    f = udp(dhcp(rnd, mac).serialize(), src=mac)
    return f[:rnd.randrange(14, len(f) - 1)]


def _truncated_dhcp(rnd, mac):
    m = dhcp(rnd, mac).serialize()
    return udp(m[:rnd.randrange(0, opts_end(m))], src=mac)


def _wrong_op(rnd, mac):
    m = bytearray(dhcp(rnd, mac).serialize())
    m[0] = rnd.choice([0, 2, 2, 3, rnd.randrange(3, 256)])
    return udp(bytes(m), src=mac)


def _bad_option_length(rnd, mac):
    code, lens = rnd.choice([(Opt.REQUESTED_IP, (0, 3, 5, 8)), (Opt.MSG_TYPE, (0, 2)), (Opt.SERVER_ID, (2, 6)),
                             (Opt.MAX_MESSAGE_SIZE, (1, 3)), (Opt.LEASE_TIME, (3, 5))])
    n = rnd.choice(lens)
    opt = bytes([code, n]) + bytes(rnd.randrange(256) for _ in range(n))
    body = (opt + MT) if code != Opt.MSG_TYPE else opt
    return udp(with_options(rnd, body + bytes([END])), src=mac)


def _option_overruns(rnd, mac):
    cut = rnd.randrange(1, 250)
    return udp(with_options(rnd, MT + bytes([rnd.randrange(1, 255), 255]) + bytes(cut)[:cut]), src=mac)


def _message_type(rnd, mac):
    return udp(with_options(rnd, bytes([Opt.MSG_TYPE, 1, rnd.choice([0, 9, 18, 255])]) + bytes([END])), src=mac)


def _server_type(rnd, mac):
    t = rnd.choice([MessageType.OFFER, MessageType.ACK, MessageType.NAK])
    return udp(with_options(rnd, bytes([Opt.MSG_TYPE, 1, t, END])), src=mac)


def _no_type_or_cookie(rnd, mac):
    m = bytearray(dhcp(rnd, mac).serialize())
    if rnd.random() < 0.5:
        m[MIN_LEN - 4:MIN_LEN] = rnd.randbytes(4) if rnd.random() < 0.9 else b"\0\0\0\0"
        if bytes(m[MIN_LEN - 4:MIN_LEN]) == bytes.fromhex("63825363"):
            m[MIN_LEN - 1] ^= 1
        return udp(bytes(m), src=mac)
    return udp(with_options(rnd, bytes([Opt.HOSTNAME, 3]) + b"abc" + bytes([END])), src=mac)


def _overload_garbage(rnd, mac):
    which = rnd.choice([1, 2, 3])
    return udp(with_options(rnd, MT + bytes([Opt.OVERLOAD, 1, which, END]), file=garbage(rnd, 128),
                            sname=garbage(rnd, 64)), src=mac)


def _overload_value(rnd, mac):
    value = rnd.choice([b"", b"\x00", b"\x04", b"\xff", b"\x01\x02"])
    return udp(with_options(rnd, MT + bytes([Opt.OVERLOAD, len(value)]) + value + bytes([END])), src=mac)


def _overload_loop(rnd, mac):
    inner = bytes([Opt.OVERLOAD, 1, 2, END])  # file says: sname too (only the options field may say that)
    return udp(with_options(rnd, MT + bytes([Opt.OVERLOAD, 1, 1, END]), file=inner), src=mac)


def _hardware(rnd, mac):
    m = bytearray(dhcp(rnd, mac).serialize())
    kind = rnd.randrange(3)
    if kind == 0:
        m[2] = rnd.randrange(17, 256)          # hlen beyond chaddr
    elif kind == 1:
        m[1] = rnd.choice([0, 6, 32])          # not Ethernet
    else:
        m[2] = rnd.choice([0, 4, 8])           # Ethernet with the wrong address length
    return udp(bytes(m), src=mac)


def _spoofed(rnd, mac):
    other = bytes([0x02]) + rnd.randbytes(5)
    return udp(dhcp(rnd, other).serialize(), src=mac)


def _untrusted_relay(rnd, mac):
    other = bytes([0x02]) + rnd.randbytes(5)
    return udp(dhcp(rnd, other, giaddr=IPv4Address(f"10.{rnd.randrange(256)}.0.1")).serialize(), src=mac,
               sport=67)


def _oversize(rnd, mac):
    m = dhcp(rnd, mac).serialize()
    return udp(m + bytes(rnd.randrange(1477 - len(m), 9000 - len(m))), src=mac)


def _broken_ip_udp(rnd, mac):
    f = bytearray(udp(dhcp(rnd, mac).serialize(), src=mac))
    kind = rnd.randrange(5)
    if kind == 0:
        f[-1] ^= 1 + rnd.randrange(255)        # UDP checksum
    elif kind == 1:
        f[14 + 10] ^= 1 + rnd.randrange(255)   # IP header checksum
    elif kind == 2:
        f[14 + 6] |= 0x20                      # more fragments
    elif kind == 3:
        f[14 + 9] = 6                          # TCP
    else:
        return udp(dhcp(rnd, mac).serialize(), src=mac, dport=rnd.choice([68, 53, 547]))
    return bytes(f)


def _mutated(rnd, mac):
    f = bytearray(udp(dhcp(rnd, mac).serialize(), src=mac))
    for _ in range(rnd.randint(1, 8)):
        i = rnd.randrange(UDP_OFF, len(f))
        f[i] = rnd.randrange(256)
    return ipudp.Datagram(BCAST, mac, IPv4Address(0), IPv4Address("255.255.255.255"), 68, 67,
                          bytes(f[UDP_OFF:])).serialize()


def _random_bytes(rnd, mac):
    return udp(rnd.randbytes(rnd.randrange(0, 600)), src=mac)


def _good(rnd, mac):
    return udp(dhcp(rnd, mac).serialize(), src=mac)


MALFORMED = {"malformed"}
FAMILIES = {
    "truncated_frame": (_truncated_frame, {"wrap"}),
    "truncated_dhcp": (_truncated_dhcp, MALFORMED),
    "wrong_op": (_wrong_op, {"wrong_op", "malformed"}),
    "bad_option_length": (_bad_option_length, MALFORMED),
    "option_overruns": (_option_overruns, MALFORMED),
    "unknown_message_type": (_message_type, MALFORMED),
    "server_message_type": (_server_type, {"wrong_type"}),
    "no_type_or_bad_cookie": (_no_type_or_cookie, MALFORMED),
    "overload_to_garbage": (_overload_garbage, MALFORMED),
    "overload_bad_value": (_overload_value, MALFORMED),
    "overload_loop": (_overload_loop, MALFORMED),
    "hardware_lies": (_hardware, {"malformed", "bad_chaddr"}),
    "chaddr_not_source": (_spoofed, {"spoofed"}),
    "untrusted_relay": (_untrusted_relay, {"relayed_dropped"}),
    "oversize": (_oversize, {"wrap"}),
    "broken_ip_udp": (_broken_ip_udp, {"wrap"}),
    "mutated": (_mutated, None),          # anything, but only ever one of the outcomes
    "random_bytes": (_random_bytes, None),
    "good": (_good, {"served"}),
}
# What a live shard must refuse whatever its state, and that fits a 1500 B link.
MUST_REFUSE = [k for k, (_, out) in FAMILIES.items() if out is not None and "served" not in out and k != "oversize"]


def bad_frames(rnd: random.Random, mac: bytes, n: int) -> list[bytes]:
    """``n`` frames from ``mac`` (its own port: they pass port security) that a shard must refuse."""
    return [FAMILIES[rnd.choice(MUST_REFUSE)][0](rnd, mac) for _ in range(n)]


def through_shard(backend: SdhcpBackend, raw: bytes) -> str:
    """One frame down a shard's receive path (as ``SdhcpLoop._handle`` and the loop run it): its outcome."""
    try:
        wrapped = frames.wrap(raw, PORT_MAC)
    except DhcpError:
        return "wrap"
    frame = parse_vfab(wrapped)                 # the wrap builds a valid vfab REQUEST, always
    assert frame.type is FrameType.REQUEST and frame.src == raw[6:12]
    before = collections.Counter(backend.counters)
    try:
        key = backend.key_of(frame.payload)
    except BadRequest:
        raised = {k: v - before.get(k, 0) for k, v in backend.counters.items() if v != before.get(k, 0)}
        assert list(raised.values()) == [1], f"a refusal must raise exactly one counter by one: {raised}"
        return next(iter(raised))
    backend.handle_batch([Request(frame.payload, key, frame.src)])
    return "served"


@pytest.fixture
def backend(tmp_path):
    b = SdhcpBackend(Store(str(tmp_path / "fuzz.sqlite"), parse_opts(OPTS)))
    yield b
    b.store.close()


def test_every_hostile_frame_is_refused_and_counted_or_served(backend):
    rnd = random.Random(20260509)
    seen: dict[str, collections.Counter] = {name: collections.Counter() for name in FAMILIES}
    names = list(FAMILIES)
    for i in range(N):
        name = names[i % len(names)]
        gen, allowed = FAMILIES[name]
        raw = gen(rnd, MAC)
        outcome = through_shard(backend, raw)     # any exception but the module's own fails the test here
        if allowed is not None:
            assert outcome in allowed, f"{name}: frame {raw.hex()} ended as {outcome}, expected one of {allowed}"
        seen[name][outcome] += 1
    for name, out in seen.items():
        assert sum(out.values()) >= N // len(FAMILIES), (name, out)
    # the families that may go either way did go both ways (the generator is not trivially rejected)
    assert seen["mutated"]["served"] and set(seen["mutated"]) - {"served"}, seen["mutated"]
    assert seen["wrong_op"]["wrong_op"] and seen["wrong_op"]["malformed"], seen["wrong_op"]
    refused = sum(n for out in seen.values() for k, n in out.items() if k not in ("wrap", "served"))
    assert refused == sum(v for k, v in backend.counters.items() if k in {
        "malformed", "wrong_op", "bad_chaddr", "wrong_type", "spoofed", "relayed_dropped"})
    # and the shard still serves a plain client afterwards
    assert through_shard(backend, udp(Message(op=1, xid=1, chaddr=bytes.fromhex("025d00700007"), options={
        Opt.MSG_TYPE: bytes([MessageType.DISCOVER])}).serialize(), src=bytes.fromhex("025d00700007"))) == "served"
    print({k: dict(v) for k, v in seen.items()})


def test_bad_frames_are_all_refused_and_fit_a_link(backend):
    rnd = random.Random(3)
    burst = bad_frames(rnd, MAC, 2000)
    assert all(len(f) <= 1514 for f in burst)
    outcomes = collections.Counter(through_shard(backend, f) for f in burst)
    assert "served" not in outcomes, outcomes
    assert backend.store.count(FULL) == 0, "a refused frame left a row behind"
