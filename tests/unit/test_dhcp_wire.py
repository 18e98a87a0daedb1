"""sdhcp's DHCP wire format, reply rules and IPv4/UDP framing, without a network.

Messages with overload or split options are built byte by byte here (not with
``serialize``), so parse is checked against the RFC layout rather than against
itself; checksums are checked against a published vector and a second,
differently computed implementation.
"""

from __future__ import annotations

import random
import struct
from ipaddress import IPv4Address

import pytest

from vfab.services.sdhcp import ipudp, wire
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.reply import (
    BROADCAST_IP,
    BROADCAST_MAC,
    Destination,
    destination,
    prepare,
    reply,
    reply_limit,
)
from vfab.services.sdhcp.wire import FLAG_BROADCAST, Message, MessageType, Opt, encode_option, parse
from vfab.vid.errors import VfabError

MAC = bytes.fromhex("02005e0000a1")
SERVER = IPv4Address("192.0.2.1")
OFFERED = IPv4Address("192.0.2.50")
COOKIE = bytes((99, 130, 83, 99))


def raw(options: bytes, *, op: int = 1, hlen: int = 6, chaddr: bytes = MAC, sname: bytes = b"",
        file: bytes = b"", cookie: bytes = COOKIE, flags: int = 0, giaddr: bytes = bytes(4)) -> bytes:
    """A DHCP message laid out by hand (RFC 2131 Figure 1), independent of wire.serialize."""
    head = bytes((op, 1, hlen, 0)) + (0xDEADBEEF).to_bytes(4, "big") + (7).to_bytes(2, "big")
    head += flags.to_bytes(2, "big") + bytes(12) + giaddr
    head += chaddr.ljust(16, b"\0") + sname.ljust(64, b"\0") + file.ljust(128, b"\0")
    assert len(head) == 236
    return head + cookie + options


def tlv(code: int, value: bytes) -> bytes:
    return bytes((code, len(value))) + value


DISCOVER_OPTS = tlv(53, b"\x01") + tlv(61, b"\x01" + MAC) + tlv(55, bytes((1, 3, 6, 12, 15, 28, 42))) + b"\xff"


def discover(**kw) -> Message:
    opts = {53: bytes((MessageType.DISCOVER,)), 61: b"\x01" + MAC, 55: bytes((1, 3, 6))}
    opts.update(kw.pop("options", {}))
    return Message(op=1, xid=0x12345678, chaddr=kw.pop("chaddr", MAC), options=opts, **kw)


def request_for(offer: Message, **kw) -> Message:
    opts = {53: bytes((MessageType.REQUEST,)), 50: offer.yiaddr.packed, 54: offer.options[54],
            61: b"\x01" + MAC}
    opts.update(kw.pop("options", {}))
    return Message(op=1, xid=offer.xid, chaddr=MAC, options=opts, **kw)


# ----------------------------------------------------------------------------- round trips


def test_hand_built_discover_parses() -> None:
    m = parse(raw(DISCOVER_OPTS, flags=FLAG_BROADCAST))
    assert (m.op, m.htype, m.xid, m.secs) == (1, 1, 0xDEADBEEF, 7)
    assert m.msg_type is MessageType.DISCOVER and m.broadcast
    assert m.chaddr == MAC and m.client_id == b"\x01" + MAC
    assert m.param_request_list == (1, 3, 6, 12, 15, 28, 42)
    assert m.ciaddr == m.yiaddr == m.siaddr == m.giaddr == IPv4Address(0)
    assert m.sname == m.file == b""


def test_every_header_field_round_trips() -> None:
    m = Message(op=2, xid=0xFFFFFFFF, chaddr=bytes(range(1, 17)), htype=6, hops=3, secs=65535, flags=0xFFFF,
                ciaddr="10.0.0.1", yiaddr="10.0.0.2", siaddr="10.0.0.3", giaddr="10.0.0.4",
                sname=b"boot-server", file=b"/pxelinux.0", options={53: b"\x05", 250: b"", 251: b"\x00\x01"})
    data = m.serialize()
    assert len(data) == 300 and data[236:240] == COOKIE
    assert data[2] == 16 and data[44:55] == b"boot-server"
    back = parse(data)
    assert back == m
    assert back.options[250] == b"" and list(back.options) == [53, 250, 251]


def test_serialize_pads_to_bootp_minimum_and_normalises() -> None:
    m = discover(sname=b"x\0\0", chaddr=MAC)
    assert m.sname == b"x"  # trailing NULs are field padding, not content
    data = m.serialize()
    assert len(data) == wire.BOOTP_MIN_LEN and data[-1] == 0
    big = discover(options={200: b"z" * 200})
    assert len(big.serialize()) > wire.BOOTP_MIN_LEN


def test_short_chaddr_and_hlen() -> None:
    m = parse(raw(DISCOVER_OPTS, hlen=0))
    assert m.chaddr == b"" and parse(m.serialize()) == m
    m = parse(raw(DISCOVER_OPTS, hlen=16, chaddr=bytes(range(16))))
    assert m.chaddr == bytes(range(16)) and m.serialize()[2] == 16


def test_bytes_after_end_and_pads_are_ignored() -> None:
    opts = b"\x00\x00" + tlv(53, b"\x03") + b"\x00" + tlv(50, OFFERED.packed) + b"\xff" + b"garbage-after-end"
    m = parse(raw(opts))
    assert m.options == {53: b"\x03", 50: OFFERED.packed}


# ----------------------------------------------------------------------------- options


TYPED = [
    (Opt.SUBNET_MASK, "255.255.255.0", b"\xff\xff\xff\x00", "subnet_mask", IPv4Address("255.255.255.0")),
    (Opt.ROUTER, ["192.0.2.1", "192.0.2.2"], bytes((192, 0, 2, 1, 192, 0, 2, 2)), "routers",
     [IPv4Address("192.0.2.1"), IPv4Address("192.0.2.2")]),
    (Opt.DNS, "192.0.2.53", bytes((192, 0, 2, 53)), "dns_servers", [IPv4Address("192.0.2.53")]),
    (Opt.HOSTNAME, "client-7", b"client-7", "hostname", "client-7"),
    (Opt.REQUESTED_IP, OFFERED, OFFERED.packed, "requested_ip", OFFERED),
    (Opt.LEASE_TIME, 86400, b"\x00\x01\x51\x80", "lease_time", 86400),
    (Opt.SERVER_ID, "192.0.2.1", SERVER.packed, "server_id", SERVER),
    (Opt.PARAM_REQUEST_LIST, [1, 3, 6, 51], b"\x01\x03\x06\x33", "param_request_list", (1, 3, 6, 51)),
    (Opt.MESSAGE, "address in use", b"address in use", "message", "address in use"),
    (Opt.MAX_MESSAGE_SIZE, 1500, b"\x05\xdc", "max_message_size", 1500),
    (Opt.RENEWAL_TIME, 43200, (43200).to_bytes(4, "big"), "t1", 43200),
    (Opt.REBINDING_TIME, 75600, (75600).to_bytes(4, "big"), "t2", 75600),
    (Opt.VENDOR_CLASS, b"udhcp 1.35.0", b"udhcp 1.35.0", "vendor_class", b"udhcp 1.35.0"),
    (Opt.CLIENT_ID, b"\x01" + MAC, b"\x01" + MAC, "client_id", b"\x01" + MAC),
]


@pytest.mark.parametrize("code,value,wire_bytes,attr,decoded", TYPED, ids=[t[3] for t in TYPED])
def test_each_option_encodes_parses_and_decodes(code, value, wire_bytes, attr, decoded) -> None:
    assert encode_option(code, value) == wire_bytes
    m = parse(raw(tlv(53, b"\x01") + tlv(code, wire_bytes) + b"\xff"))
    assert m.options[code] == wire_bytes
    assert getattr(m, attr) == decoded
    assert parse(m.serialize()) == m


def test_absent_options_read_as_none_or_empty() -> None:
    m = parse(raw(tlv(53, b"\x08") + b"\xff"))
    assert m.msg_type is MessageType.INFORM
    assert m.requested_ip is m.server_id is m.lease_time is m.client_id is m.hostname is None
    assert m.routers == [] and m.param_request_list == ()


def test_message_types_cover_the_enum() -> None:
    assert [t.name for t in MessageType] == ["DISCOVER", "OFFER", "REQUEST", "DECLINE", "ACK", "NAK",
                                             "RELEASE", "INFORM"]
    for t in MessageType:
        assert parse(raw(tlv(53, bytes((t,))) + b"\xff")).msg_type is t


def test_unknown_options_are_kept_raw_and_in_order() -> None:
    opts = tlv(53, b"\x01") + tlv(81, b"\x00\x00\x00abc") + tlv(80, b"") + tlv(224, bytes(range(40))) + b"\xff"
    m = parse(raw(opts))
    assert list(m.options) == [53, 81, 80, 224]
    assert m.options[80] == b"" and m.options[224] == bytes(range(40))
    assert m.serialize()[240:240 + len(opts)] == opts


def test_encode_option_rejects_values_that_do_not_fit() -> None:
    for code, value, needle in [(Opt.LEASE_TIME, -1, "lease time"), (Opt.LEASE_TIME, 1 << 32, "lease time"),
                                (Opt.SUBNET_MASK, "300.1.1.1", "subnet mask"), (Opt.HOSTNAME, "é", "hostname"),
                                (Opt.ROUTER, b"\x01\x02\x03", "multiple of 4"), (Opt.CLIENT_ID, b"\x01", "at least 2"),
                                (Opt.MSG_TYPE, 9, "message type 9"), (200, "text", "does not encode"),
                                (0, b"", "option code 0"), (255, b"", "option code 255"), (52, b"\x01", "overload")]:
        with pytest.raises(DhcpError, match=needle):
            encode_option(code, value)


# ----------------------------------------------------------------------------- overload (52)


def test_overload_file_then_sname_in_rfc_order() -> None:
    # hostname split over all three fields: options, then file, then sname (RFC 3396 §5)
    opts = tlv(53, b"\x05") + tlv(52, b"\x03") + tlv(12, b"ab") + b"\xff"
    file = tlv(12, b"cd") + tlv(51, (600).to_bytes(4, "big")) + b"\xff"
    sname = tlv(12, b"ef") + tlv(54, SERVER.packed) + b"\xff"
    m = parse(raw(opts, op=2, file=file, sname=sname))
    assert m.hostname == "abcdef"
    assert m.lease_time == 600 and m.server_id == SERVER
    assert list(m.options) == [53, 12, 51, 54]
    assert m.file == m.sname == b""  # they held options, not names
    assert Opt.OVERLOAD not in m.options
    assert parse(m.serialize()) == m


def test_overload_file_only_keeps_sname_as_a_name() -> None:
    opts = tlv(53, b"\x02") + tlv(52, b"\x01") + b"\xff"
    m = parse(raw(opts, op=2, file=tlv(3, SERVER.packed) + b"\xff", sname=b"tftp.example"))
    assert m.routers == [SERVER] and m.sname == b"tftp.example" and m.file == b""


def test_overload_sname_only_keeps_file_as_a_name() -> None:
    opts = tlv(53, b"\x02") + tlv(52, b"\x02") + b"\xff"
    m = parse(raw(opts, op=2, sname=tlv(1, b"\xff\xff\xff\x00") + b"\xff", file=b"/boot/x"))
    assert m.subnet_mask == IPv4Address("255.255.255.0") and m.file == b"/boot/x" and m.sname == b""


def test_without_overload_file_and_sname_are_not_scanned() -> None:
    m = parse(raw(tlv(53, b"\x02") + b"\xff", op=2, file=tlv(51, b"\x00\x00\x00\x01") + b"\xff"))
    assert m.lease_time is None and m.file.startswith(b"\x33\x04")


def test_serialize_overloads_to_fit_max_size() -> None:
    offer = reply(discover(), MessageType.OFFER, SERVER, OFFERED,
                  options={Opt.LEASE_TIME: 3600, Opt.SUBNET_MASK: "255.255.255.0", 224: b"v" * 420, 225: b"w" * 40})
    plain = offer.serialize()
    assert len(plain) > 576 and plain[240] == 53  # no limit: everything in the options field
    data = offer.serialize(max_size=576)
    assert len(data) == 576
    assert data[240:243] == bytes((52, 1, 3))  # overload first, file and sname both used
    assert data[wire.FILE_OFF] != 0 and data[wire.SNAME_OFF] != 0
    assert parse(data) == offer


def test_overload_never_splits_fixed_size_options() -> None:
    # fill the options field so that the lease time lands on a field boundary
    for filler in range(280, 330):
        m = reply(discover(), MessageType.OFFER, SERVER, OFFERED,
                  options={224: b"f" * filler, Opt.LEASE_TIME: 3600, Opt.RENEWAL_TIME: 1800})
        data = m.serialize(max_size=576)
        assert parse(data) == m
        for start, end in ((240, 576), (wire.FILE_OFF, wire.FILE_OFF + 128), (wire.SNAME_OFF, wire.SNAME_OFF + 64)):
            i = start + (3 if start == 240 else 0)
            while i < end and data[i] not in (0, 255):
                if data[i] in (Opt.LEASE_TIME, Opt.RENEWAL_TIME, Opt.SERVER_ID):
                    assert data[i + 1] == 4, f"filler {filler}: option {data[i]} split at byte {i}"
                i += 2 + data[i + 1]


def test_serialize_says_when_even_overload_is_too_small() -> None:
    m = discover(options={224: b"x" * 600})
    with pytest.raises(DhcpError, match="even with the file and sname fields overloaded"):
        m.serialize(max_size=576)
    with pytest.raises(DhcpError, match="too small"):
        m.serialize(max_size=200)


def test_named_file_and_sname_are_not_used_for_overflow() -> None:
    m = discover(file=b"/boot/image", sname=b"srv", options={224: b"x" * 320})
    with pytest.raises(DhcpError, match="overloaded"):
        m.serialize(max_size=548)
    m = discover(file=b"/boot/image", options={224: b"x" * 320})
    data = m.serialize(max_size=548)
    assert data[242] == 2 and parse(data) == m  # only sname was free


# ----------------------------------------------------------------------------- RFC 3396 long options


def test_long_option_is_split_into_255_byte_instances() -> None:
    value = (bytes(range(256)) * 3)[:700]
    m = discover(options={224: value})
    data = m.serialize()
    i = data.index(bytes((224, 255)))
    assert data[i + 257:i + 259] == bytes((224, 255))
    assert data[i + 514:i + 516] == bytes((224, 700 - 510))
    assert parse(data).options[224] == value


def test_instances_are_concatenated_even_when_not_adjacent() -> None:
    opts = tlv(53, b"\x01") + tlv(6, bytes((192, 0, 2, 53))) + tlv(12, b"x") + tlv(6, bytes((192, 0, 2, 54))) + b"\xff"
    m = parse(raw(opts))
    assert m.dns_servers == [IPv4Address("192.0.2.53"), IPv4Address("192.0.2.54")]
    assert list(m.options) == [53, 6, 12]


def test_fixed_length_is_checked_after_concatenation() -> None:
    ok = tlv(53, b"\x01") + tlv(51, b"\x00\x00") + tlv(51, b"\x0e\x10") + b"\xff"
    assert parse(raw(ok)).lease_time == 3600
    bad = tlv(53, b"\x01") + tlv(51, b"\x00\x00\x0e\x10") + tlv(51, b"\x00") + b"\xff"
    with pytest.raises(DhcpError, match=r"option 51 \(lease time\) is 5 B long"):
        parse(raw(bad))


def test_empty_and_exactly_255_byte_values() -> None:
    m = discover(options={224: b"", 225: b"a" * 255, 226: b"b" * 256})
    data = m.serialize()
    assert bytes((224, 0)) in data and data.count(bytes((226,))) >= 2
    assert parse(data) == m


# ----------------------------------------------------------------------------- malformed input


MALFORMED = [
    ("truncated header", raw(DISCOVER_OPTS)[:200], "truncated DHCP message: 200 B"),
    ("empty", b"", "truncated DHCP message: 0 B"),
    ("bad cookie", raw(DISCOVER_OPTS, cookie=b"\x63\x82\x53\x64"), "bad magic cookie 0x63825364"),
    ("op 0", raw(DISCOVER_OPTS, op=0), "op 0 is neither"),
    ("op 3", raw(DISCOVER_OPTS, op=3), "op 3 is neither"),
    ("hlen 17", raw(DISCOVER_OPTS, hlen=17), "hlen 17 is larger than the 16 B chaddr"),
    ("option past end", raw(tlv(53, b"\x01") + bytes((12, 10)) + b"abc"), r"option 12 \(hostname\) .* claims 10 B"),
    ("no length byte", raw(tlv(53, b"\x01") + bytes((61,))), "has no length byte"),
    ("no end option", raw(tlv(53, b"\x01")), "options field has no end option"),
    ("lease time 3 B", raw(tlv(53, b"\x01") + tlv(51, b"\x00\x00\x01") + b"\xff"),
     r"option 51 \(lease time\) is 3 B long: it must be exactly 4 B"),
    ("T1 2 B", raw(tlv(53, b"\x03") + tlv(58, b"\x00\x01") + b"\xff"), r"option 58 \(renewal time T1\)"),
    ("server id 5 B", raw(tlv(53, b"\x03") + tlv(54, b"\x01\x02\x03\x04\x05") + b"\xff"), "server identifier"),
    ("requested ip 0 B", raw(tlv(53, b"\x03") + tlv(50, b"") + b"\xff"), "requested address"),
    ("router 6 B", raw(tlv(53, b"\x02") + tlv(3, b"\x01" * 6) + b"\xff"), "non-zero multiple of 4"),
    ("max size 1 B", raw(tlv(53, b"\x01") + tlv(57, b"\x05") + b"\xff"), "maximum message size"),
    ("client id 1 B", raw(tlv(53, b"\x01") + tlv(61, b"\x01") + b"\xff"), "at least 2 B"),
    ("empty PRL", raw(tlv(53, b"\x01") + tlv(55, b"") + b"\xff"), "parameter request list"),
    ("message type 0", raw(tlv(53, b"\x00") + b"\xff"), "message type 0 is unknown"),
    ("message type 2 B", raw(tlv(53, b"\x01\x01") + b"\xff"), "message type"),
    ("missing message type", raw(tlv(50, OFFERED.packed) + b"\xff"), "no message type"),
    ("plain BOOTP", raw(b"\xff"), "no message type"),
    ("overload value 4", raw(tlv(53, b"\x01") + tlv(52, b"\x04") + b"\xff"), "option 52 .* is 04"),
    ("overload twice", raw(tlv(53, b"\x01") + tlv(52, b"\x01") + tlv(52, b"\x01") + b"\xff"), "option 52 .* 0101"),
    ("overload loop in file", raw(tlv(53, b"\x01") + tlv(52, b"\x03") + b"\xff", file=tlv(52, b"\x03") + b"\xff"),
     "inside the file field.*loop"),
    ("overload loop in sname", raw(tlv(53, b"\x01") + tlv(52, b"\x02") + b"\xff", sname=tlv(52, b"\x01") + b"\xff"),
     "inside the sname field.*loop"),
    ("overloaded file without end", raw(tlv(53, b"\x01") + tlv(52, b"\x01") + b"\xff", file=b"\x0c\x02ab" * 32),
     "file field has no end option"),
    ("option past end of sname", raw(tlv(53, b"\x01") + tlv(52, b"\x02") + b"\xff", sname=b"\x00" * 60 + b"\x0c\x09ab"),
     "sname field claims 9 B"),
]


@pytest.mark.parametrize("data,needle", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_messages_raise_dhcp_error_saying_what(data: bytes, needle: str) -> None:
    with pytest.raises(DhcpError, match=needle) as info:
        parse(data)
    assert isinstance(info.value, VfabError) and isinstance(info.value, ValueError)


def test_parse_rejects_non_bytes() -> None:
    with pytest.raises(DhcpError, match="as bytes"):
        parse("not bytes")  # type: ignore[arg-type]


def test_message_constructor_checks_fields() -> None:
    cases = [({"chaddr": b"x" * 17}, "chaddr"), ({"ciaddr": "10.0.0.300"}, "ciaddr"), ({"xid": -1}, "xid"),
             ({"flags": 1 << 16}, "flags"), ({"op": 5}, "op 5"), ({"sname": b"s" * 65}, "sname"),
             ({"file": "str"}, "file"), ({"options": {53: 1}}, "wire bytes"), ({"options": {52: b"\x01"}}, "overload"),
             ({"options": {}}, "no message type"), ({"options": [(53, b"\x01")]}, "must be a dict")]
    for kw, needle in cases:
        args = {"op": 1, "xid": 1, "chaddr": MAC, "options": {53: b"\x01"}} | kw
        with pytest.raises(DhcpError, match=needle):
            Message(**args)


# ----------------------------------------------------------------------------- reply builder


def test_offer_copies_what_rfc2131_says() -> None:
    req = discover(flags=FLAG_BROADCAST, giaddr="198.51.100.1", secs=9, hops=2)
    offer = reply(req, MessageType.OFFER, SERVER, OFFERED, options={Opt.LEASE_TIME: 600, Opt.RENEWAL_TIME: 300,
                                                                    Opt.REBINDING_TIME: 525})
    assert offer.op == 2 and offer.msg_type is MessageType.OFFER
    assert (offer.xid, offer.flags, offer.giaddr, offer.chaddr, offer.htype) == (req.xid, req.flags, req.giaddr,
                                                                                  req.chaddr, req.htype)
    assert offer.hops == offer.secs == 0 and offer.ciaddr == IPv4Address(0)
    assert offer.yiaddr == OFFERED and offer.server_id == SERVER and offer.lease_time == 600
    assert list(offer.options)[:2] == [53, 54]
    assert offer.client_id == req.client_id  # RFC 6842 echo
    assert parse(offer.serialize()) == offer


def test_ack_copies_ciaddr_and_inform_gets_no_lease() -> None:
    renew = Message(op=1, xid=5, chaddr=MAC, ciaddr=OFFERED, options={53: b"\x03"})
    ack = reply(renew, MessageType.ACK, SERVER, OFFERED, options={Opt.LEASE_TIME: 60})
    assert ack.ciaddr == OFFERED and ack.client_id is None
    inform = Message(op=1, xid=6, chaddr=MAC, ciaddr=OFFERED, options={53: b"\x08"})
    ack = reply(inform, MessageType.ACK, SERVER, options={Opt.DNS: ["192.0.2.53"]})
    assert ack.yiaddr == IPv4Address(0) and ack.lease_time is None
    with pytest.raises(DhcpError, match="INFORM must not carry a lease time"):
        reply(inform, MessageType.ACK, SERVER, options={Opt.LEASE_TIME: 60})
    with pytest.raises(DhcpError, match="yiaddr must be 0"):
        reply(inform, MessageType.ACK, SERVER, OFFERED)


def test_nak_rules() -> None:
    req = request_for(reply(discover(), MessageType.OFFER, SERVER, OFFERED, options={Opt.LEASE_TIME: 60}))
    nak = reply(req, MessageType.NAK, SERVER, options={Opt.MESSAGE: "wrong network"})
    assert nak.yiaddr == IPv4Address(0) and nak.message == "wrong network" and not nak.broadcast
    relayed = request_for(reply(discover(), MessageType.OFFER, SERVER, OFFERED, options={Opt.LEASE_TIME: 60}),
                          giaddr="198.51.100.1")
    assert reply(relayed, MessageType.NAK, SERVER).broadcast  # RFC 2131 §4.3.2
    with pytest.raises(DhcpError, match="yiaddr must be 0"):
        reply(req, MessageType.NAK, SERVER, OFFERED)
    with pytest.raises(DhcpError, match="may not appear in a NAK"):
        reply(req, MessageType.NAK, SERVER, options={Opt.LEASE_TIME: 60})


@pytest.mark.parametrize("kwargs,needle", [
    ({"msg_type": MessageType.ACK}, "ACK answers a INFORM or REQUEST, not a DISCOVER"),
    ({"msg_type": MessageType.REQUEST}, "OFFER, ACK or NAK"),
    ({"msg_type": 42}, "OFFER, ACK or NAK"),
    ({"yiaddr": "0.0.0.0"}, "must carry the address"),
    ({"options": {}}, "lease time"),
    ({"options": {Opt.LEASE_TIME: 60, Opt.CLIENT_ID: b"\x01ab"}}, "not the caller's"),
    ({"options": {Opt.LEASE_TIME: 60, Opt.PARAM_REQUEST_LIST: [1]}}, "not the caller's"),
    ({"options": {Opt.LEASE_TIME: 60, Opt.RENEWAL_TIME: 50, Opt.REBINDING_TIME: 40}}, "T1 <= T2"),
    ({"options": {Opt.LEASE_TIME: 60, Opt.RENEWAL_TIME: 90}}, "T1 <= T2"),
    ({"yiaddr": "not-an-ip"}, "yiaddr 'not-an-ip' is not an IPv4 address"),
])
def test_reply_refuses_what_rfc2131_forbids(kwargs, needle) -> None:
    args = {"msg_type": MessageType.OFFER, "server_id": SERVER, "yiaddr": OFFERED,
            "options": {Opt.LEASE_TIME: 60}} | kwargs
    with pytest.raises(DhcpError, match=needle):
        reply(discover(), args.pop("msg_type"), **args)


def test_prepared_options_give_the_same_replies_and_keep_the_rules() -> None:
    """A server's options encoded and checked once (prepare) build the very replies a dict of them builds,
    and every rule that depends on the reply (a NAK's options, a lease time in an OFFER, none to an INFORM)
    is still checked per reply."""
    opts = {Opt.LEASE_TIME: 600, Opt.RENEWAL_TIME: 300, Opt.REBINDING_TIME: 525, Opt.DNS: ["192.0.2.53"]}
    ready = prepare(opts)
    req = discover()
    assert reply(req, MessageType.OFFER, SERVER, OFFERED, options=ready).serialize() == \
        reply(req, MessageType.OFFER, SERVER, OFFERED, options=opts).serialize()
    ack_req = request_for(reply(req, MessageType.OFFER, SERVER, OFFERED, options=ready))
    assert reply(ack_req, MessageType.ACK, SERVER, OFFERED, options=ready) == \
        reply(ack_req, MessageType.ACK, SERVER, OFFERED, options=opts)
    with pytest.raises(DhcpError, match=r"option 51 \(lease time\) may not appear in a NAK"):
        reply(ack_req, MessageType.NAK, SERVER, options=ready)
    inform = Message(op=1, xid=6, chaddr=MAC, ciaddr=OFFERED, options={53: b"\x08"})
    with pytest.raises(DhcpError, match="INFORM must not carry a lease time"):
        reply(inform, MessageType.ACK, SERVER, options=ready)
    with pytest.raises(DhcpError, match="must carry the lease time"):
        reply(req, MessageType.OFFER, SERVER, OFFERED, options=prepare({Opt.DNS: ["192.0.2.53"]}))
    with pytest.raises(DhcpError, match="not the caller's"):
        prepare({Opt.SERVER_ID: SERVER})
    with pytest.raises(DhcpError, match="T1 <= T2"):
        prepare({Opt.LEASE_TIME: 60, Opt.RENEWAL_TIME: 90})
    assert reply(ack_req, MessageType.NAK, SERVER, options=prepare({Opt.MESSAGE: "no"})).message == "no"


def test_reply_to_a_reply_is_refused() -> None:
    offer = reply(discover(), MessageType.OFFER, SERVER, OFFERED, options={Opt.LEASE_TIME: 60})
    with pytest.raises(DhcpError, match="answer requests only"):
        reply(offer, MessageType.ACK, SERVER, OFFERED, options={Opt.LEASE_TIME: 60})


# ----------------------------------------------------------------------------- addressing (RFC 2131 §4.1)


def _dest(req: Message, kind: MessageType = MessageType.OFFER, **kw) -> Destination:
    if kind is MessageType.NAK:
        rep = reply(req, kind, SERVER)
    else:
        rep = reply(req, kind, SERVER, OFFERED, options={Opt.LEASE_TIME: 60})
    return destination(req, rep, **kw)


def test_destination_relay_wins() -> None:
    req = discover(giaddr="198.51.100.1", flags=FLAG_BROADCAST)
    assert _dest(req) == Destination(IPv4Address("198.51.100.1"), None, 67)
    relay = bytes.fromhex("020000000099")
    assert _dest(req, relay_mac=relay) == Destination(IPv4Address("198.51.100.1"), relay, 67)
    nak_req = request_for(reply(req, MessageType.OFFER, SERVER, OFFERED, options={Opt.LEASE_TIME: 60}),
                          giaddr="198.51.100.1")
    assert _dest(nak_req, MessageType.NAK).port == 67  # the relay broadcasts it (broadcast bit set)


def test_destination_nak_is_broadcast_without_relay() -> None:
    req = Message(op=1, xid=1, chaddr=MAC, ciaddr=OFFERED, options={53: b"\x03"})
    assert _dest(req, MessageType.NAK) == Destination(BROADCAST_IP, BROADCAST_MAC, 68)


def test_destination_ciaddr_unicast_for_renewals() -> None:
    req = Message(op=1, xid=1, chaddr=MAC, ciaddr=OFFERED, flags=FLAG_BROADCAST, options={53: b"\x03"})
    assert _dest(req, MessageType.ACK) == Destination(OFFERED, MAC, 68)


def test_destination_broadcast_flag_and_unicast_to_yiaddr() -> None:
    assert _dest(discover(flags=FLAG_BROADCAST)) == Destination(BROADCAST_IP, BROADCAST_MAC, 68)
    assert _dest(discover()) == Destination(OFFERED, MAC, 68)
    odd = discover(chaddr=bytes(range(8)), htype=6)  # not an Ethernet MAC: cannot unicast by chaddr
    assert _dest(odd) == Destination(BROADCAST_IP, BROADCAST_MAC, 68)


def test_reply_limit_from_option_57() -> None:
    assert reply_limit(discover()) == 548
    assert reply_limit(discover(options={57: (1500).to_bytes(2, "big")})) == 1472
    assert reply_limit(discover(options={57: (300).to_bytes(2, "big")})) == 548  # below the legal 576
    assert reply_limit(discover(options={57: (9000).to_bytes(2, "big")})) == 1472  # no fragmentation
    assert reply_limit(discover(options={57: (9000).to_bytes(2, "big")}), mtu=9000) == 8972


# ----------------------------------------------------------------------------- fuzz


def _random_message_bytes(rng: random.Random) -> bytes:
    """A plausible message: random header, random option soup (fixed-size codes once, others possibly
    repeated so that they concatenate, across fields too), sometimes overloaded."""
    fixed = {1: 4, 50: 4, 51: 4, 54: 4, 58: 4, 59: 4, 57: 2}
    used: set[int] = set()

    def soup(room: int) -> bytes:
        out = b""
        while len(out) < room - 16 and rng.random() < 0.8:
            code = rng.choice([1, 3, 6, 12, 50, 51, 54, 55, 56, 57, 58, 59, 60, 61, 0, rng.randrange(62, 255)])
            if code == 0:
                out += b"\0"
                continue
            if code in fixed and code in used:
                continue
            used.add(code)
            n = fixed.get(code) or (4 * rng.randrange(1, 3) if code in (3, 6) else rng.randrange(2, 12))
            out += tlv(code, rng.randbytes(n))
        return out

    overload = rng.choice([0, 0, 1, 2, 3])
    opts = tlv(53, bytes((rng.randrange(1, 9),))) + (tlv(52, bytes((overload,))) if overload else b"")
    opts += soup(300) + b"\xff" + b"\0" * rng.randrange(0, 4)
    file = soup(128) + b"\xff" if overload & 1 else rng.randbytes(rng.randrange(0, 20))
    sname = soup(64) + b"\xff" if overload & 2 else rng.randbytes(rng.randrange(0, 10))
    head = struct.pack("!BBBBIHH4s4s4s4s16s", rng.choice([1, 2]), rng.randrange(256), rng.randrange(17),
                       rng.randrange(256), rng.getrandbits(32), rng.getrandbits(16), rng.getrandbits(16),
                       rng.randbytes(4), rng.randbytes(4), rng.randbytes(4), rng.randbytes(4), rng.randbytes(16))
    return head + sname[:64].ljust(64, b"\0") + file[:128].ljust(128, b"\0") + COOKIE + opts


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        kind = rng.randrange(5)
        if kind == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1 and b:
            b[rng.randrange(len(b))] = rng.choice([0, 1, 2, 52, 53, 255, rng.randrange(256)])
        elif kind == 2:
            del b[rng.randrange(len(b) + 1):]
        elif kind == 3:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randrange(1, 8))
        elif b:
            i = rng.randrange(240, max(241, len(b)))
            b[i:i + 2] = bytes((rng.choice([12, 51, 52, 53, 61, 200]), rng.randrange(256)))
    return bytes(b)


def test_fuzz_parse_raises_only_dhcp_error_and_round_trips() -> None:
    rng = random.Random(20261122)
    parsed = failed = overloaded = 0
    errors: set[str] = set()
    for i in range(24000):
        data = _random_message_bytes(rng)
        if i % 3:
            data = _mutate(rng, data)
        if i % 50 == 0:
            data = rng.randbytes(rng.randrange(0, 600))
        try:
            m = parse(data)
        except DhcpError as exc:
            failed += 1
            errors.add(str(exc).split(":")[0][:30])
            continue
        parsed += 1
        overloaded += data[243:245] == bytes((52, 1)) and not m.file
        again = m.serialize()
        assert parse(again) == m, data.hex()
        limited = m.serialize(max_size=1472) if len(again) > 1472 else again
        assert parse(limited) == m
    assert parsed > 6000 and failed > 6000 and overloaded > 1000, (parsed, failed, overloaded)
    assert len(errors) > 10


def test_fuzz_ipudp_parse_raises_only_dhcp_error() -> None:
    rng = random.Random(7)
    ok = 0
    base = ipudp.Datagram(BROADCAST_MAC, MAC, IPv4Address(0), BROADCAST_IP, 68, 67, raw(DISCOVER_OPTS))
    frame = base.serialize()
    for _ in range(6000):
        data = _mutate(rng, frame) if rng.random() < 0.9 else rng.randbytes(rng.randrange(80))
        try:
            d = ipudp.parse(data, verify=rng.random() < 0.5)
        except DhcpError:
            continue
        ok += 1
        assert ipudp.parse(d.serialize()) == d
    assert ok > 100


# ----------------------------------------------------------------------------- IPv4/UDP framing


def independent_checksum(data: bytes) -> int:
    """RFC 1071 checksum by another route: 2**16 = 1 (mod 0xFFFF), so the one's complement sum of the
    16-bit words is the whole buffer read as one integer, modulo 0xFFFF (0xFFFF unless all zero)."""
    if len(data) % 2:
        data += b"\0"
    n = int.from_bytes(data, "big")
    s = n % 0xFFFF
    if s == 0 and n:
        s = 0xFFFF
    return 0xFFFF - s


def test_checksum_matches_published_vector_and_independent_sum() -> None:
    # the classic worked example of an IPv4 header checksum: 192.168.0.1 -> 192.168.0.199, UDP, 0x73 B
    header = bytes.fromhex("450000730000400040110000c0a80001c0a800c7")
    assert ipudp.checksum(header) == 0xB861
    assert ipudp.checksum(header[:10] + b"\xb8\x61" + header[12:]) == 0
    rng = random.Random(1)
    for n in list(range(0, 40)) + [rng.randrange(40, 1500) for _ in range(300)]:
        data = rng.randbytes(n)
        assert ipudp.checksum(data) == independent_checksum(data), data.hex()
    assert ipudp.checksum(b"\xff\xff") == independent_checksum(b"\xff\xff") == 0


def test_built_frame_fields_and_checksums() -> None:
    payload = raw(DISCOVER_OPTS)
    d = ipudp.Datagram(MAC, bytes.fromhex("020000000001"), SERVER, OFFERED, 67, 68, payload, ttl=64, ident=77)
    f = d.serialize()
    assert f[12:14] == b"\x08\x00" and f[14] == 0x45 and f[23] == 17
    assert int.from_bytes(f[16:18], "big") == 20 + 8 + len(payload)
    assert independent_checksum(f[14:34]) == 0
    udp = f[34:]
    pseudo = SERVER.packed + OFFERED.packed + bytes((0, 17)) + len(udp).to_bytes(2, "big")
    assert independent_checksum(pseudo + udp) == 0
    assert ipudp.parse(f) == d
    assert ipudp.parse(f + bytes(20)) == d  # Ethernet padding / trailer ignored


def test_udp_checksum_zero_is_sent_as_none_and_ffff_is_read() -> None:
    """A computed 0 goes out as 0, "none" (not RFC 768's 0xFFFF, which busybox udhcpc and dhcpcd drop:
    test_dhcp_clients); a sender's 0xFFFF for it is read as RFC 768 means it."""
    src, dst = IPv4Address("0.0.0.0"), BROADCAST_IP
    probe = ipudp.Datagram(BROADCAST_MAC, MAC, src, dst, 68, 67, b"\0\0" + b"payload!").serialize()
    c = int.from_bytes(probe[40:42], "big")
    # putting the checksum into the payload makes the one's complement sum 0xFFFF, i.e. a computed 0
    d = ipudp.Datagram(BROADCAST_MAC, MAC, src, dst, 68, 67, c.to_bytes(2, "big") + b"payload!")
    f = d.serialize()
    assert f[40:42] == b"\0\0"
    assert ipudp.parse(f) == d
    assert ipudp.parse(f[:40] + b"\xff\xff" + f[42:]) == d
    with pytest.raises(DhcpError, match="checksum"):
        ipudp.parse(f[:40] + b"\xff\xfe" + f[42:])


def test_ipudp_rejects_bad_frames_saying_what() -> None:
    good = ipudp.Datagram(BROADCAST_MAC, MAC, IPv4Address(0), BROADCAST_IP, 68, 67, b"x" * 30).serialize()

    def edit(i: int, value: bytes) -> bytes:
        return good[:i] + value + good[i + len(value):]

    cases = [
        (good[:41], "too short"),
        (edit(12, b"\x08\x06"), "EtherType 0x0806 is not IPv4"),
        (edit(14, b"\x65"), "IP version 6"),
        (edit(14, b"\x44"), "header length 16 B"),
        (edit(16, b"\x00\x10"), "total length 16 B"),
        (edit(16, b"\x04\x00"), "total length 1024 B"),
        (edit(20, b"\x20\x00"), "fragment"),
        (edit(20, b"\x00\x05"), "fragment"),
        (edit(23, b"\x06"), "protocol 6 is not UDP"),
        (edit(24, b"\x00\x00"), "bad IPv4 header checksum"),
        (edit(38, b"\x00\x04"), "UDP length 4 B"),
        (edit(40, b"\x12\x34"), "bad UDP checksum"),
        (edit(50, b"y"), "bad UDP checksum"),
    ]
    for frame, needle in cases:
        with pytest.raises(DhcpError, match=needle):
            ipudp.parse(frame)
    assert ipudp.parse(edit(40, b"\x00\x00")).payload == b"x" * 30  # 0 = no checksum
    assert ipudp.parse(edit(40, b"\x12\x34"), verify=False).payload == b"x" * 30
    with pytest.raises(DhcpError, match="6-byte MAC"):
        ipudp.Datagram(b"\xff", MAC, SERVER, OFFERED, 67, 68, b"").serialize()
    with pytest.raises(DhcpError, match="src_port"):
        ipudp.Datagram(MAC, MAC, SERVER, OFFERED, 70000, 68, b"").serialize()
    with pytest.raises(DhcpError, match="IPv4 addresses"):
        ipudp.Datagram(MAC, MAC, "nope", OFFERED, 67, 68, b"").serialize()
