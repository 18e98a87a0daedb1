"""Server replies: what RFC 2131 puts in them (§4.3, Table 3; RFC 6842) and where they go (§4.1).

Pure functions over :class:`wire.Message`; the wire format itself is :mod:`wire`'s business.

* :func:`reply` builds an OFFER, ACK or NAK for a request: op 2, the request's
  xid, flags, giaddr, htype and chaddr copied, hops and secs 0, ciaddr copied
  into an ACK only, options 53 and 54 first, the client identifier echoed
  (RFC 6842), and the Table 3 rules checked (lease time in every OFFER and in
  an ACK to a REQUEST, never in an ACK to an INFORM or a NAK; yiaddr 0 in a
  NAK and in an ACK to an INFORM; a NAK carries only a message and vendor
  class; a NAK to a relayed request gets the broadcast bit, §4.3.2).
* :func:`destination` says where the reply goes: the relay at giaddr:67;
  else a NAK is broadcast; else ciaddr (renewing, rebinding, INFORM) is
  unicast; else broadcast if the client set the broadcast flag (or chaddr is
  not an Ethernet MAC, so a unicast frame cannot be addressed); else unicast
  to yiaddr at chaddr.
* :func:`reply_limit` is the largest DHCP message the client accepts: 548 B
  (576 B IP datagram) unless option 57 says more, counted like ISC dhcpd as the
  whole IP datagram (so minus 28 B of IP+UDP headers), never beyond the link
  MTU because sdhcp does not fragment.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Mapping, NamedTuple

from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.wire import (
    BOOTREPLY,
    BOOTREQUEST,
    FLAG_BROADCAST,
    HTYPE_ETHERNET,
    ZERO,
    Message,
    MessageType,
    Opt,
    as_ip,
    encode_option,
    option_name,
)

CLIENT_PORT, SERVER_PORT = 68, 67
BROADCAST_IP = IPv4Address("255.255.255.255")
BROADCAST_MAC = b"\xff" * 6
MIN_DATAGRAM = 576  # RFC 2131 §2: every client accepts an IP datagram of 576 B
IP_UDP_HEADERS = 28
LINK_MTU = 1500

_ANSWERS = {
    MessageType.OFFER: {MessageType.DISCOVER},
    MessageType.ACK: {MessageType.REQUEST, MessageType.INFORM},
    MessageType.NAK: {MessageType.REQUEST},
}
# set by the builder itself, or never in a server reply (Table 3)
_NOT_FROM_CALLER = {Opt.MSG_TYPE, Opt.SERVER_ID, Opt.CLIENT_ID, Opt.REQUESTED_IP, Opt.PARAM_REQUEST_LIST,
                    Opt.MAX_MESSAGE_SIZE}
_NAK_MAY = {Opt.MESSAGE, Opt.VENDOR_CLASS}


_CHECKED: dict[tuple[int, object], bytes] = {}   # (code, value) -> its wire bytes, for values seen before
_CHECKED_MAX = 1024


def _encoded(code: int, value: object) -> bytes:
    """``encode_option(code, value)``, remembered for bytes and addresses: a server sends the same few
    option values (lease times, mask, its own address) in every reply, and checking them each time was a
    good part of building one."""
    if not isinstance(value, (bytes, IPv4Address)):
        return encode_option(code, value)
    key = (code, value)
    raw = _CHECKED.get(key)
    if raw is None:
        raw = encode_option(code, value)
        if len(_CHECKED) < _CHECKED_MAX:
            _CHECKED[key] = raw
    return raw


class Destination(NamedTuple):
    """Where a reply goes.  ``mac`` is None when the caller must resolve it (ARP for a relay at giaddr,
    or a client whose chaddr is not an Ethernet MAC); pass ``relay_mac`` to :func:`destination` to avoid it."""

    ip: IPv4Address
    mac: bytes | None
    port: int


class Options(NamedTuple):
    """Reply options encoded and checked once (:func:`prepare`), for a server that sends the same ones in
    reply after reply: :func:`reply` then skips encoding and checking each of them again."""

    encoded: dict[int, bytes]   # code -> wire bytes, in the order they appear
    nak_ok: bool                # only what a NAK may carry
    has_lease: bool


def prepare(options: Mapping[int, object]) -> Options:
    """``options`` (codes to typed values, see ``wire.encode_option``) encoded and checked for any reply:
    none the builder sets itself, T1 <= T2 <= lease time.  DhcpError says what is wrong."""
    extra: dict[int, bytes] = {}
    for code, value in options.items():
        if code in _NOT_FROM_CALLER:
            raise DhcpError(f"{option_name(code)} is not the caller's to set in a reply: the builder sets 53, "
                            "54 and echoes 61; 50, 55 and 57 never appear in replies (RFC 2131 Table 3)")
        extra[code] = _encoded(code, value)
    times = [int.from_bytes(extra[c], "big") for c in (Opt.RENEWAL_TIME, Opt.REBINDING_TIME, Opt.LEASE_TIME)
             if c in extra]
    if times != sorted(times):
        raise DhcpError(f"T1 <= T2 <= lease time is required (RFC 2131 §4.4.5), got {times}")
    return Options(extra, all(code in _NAK_MAY for code in extra), Opt.LEASE_TIME in extra)


def reply(request: Message, msg_type: MessageType, server_id: IPv4Address | str,
          yiaddr: IPv4Address | str = ZERO, *, options: Mapping[int, object] | Options | None = None,
          siaddr: IPv4Address | str = ZERO, sname: bytes = b"", file: bytes = b"") -> Message:
    """The OFFER/ACK/NAK answering ``request``; ``options`` maps codes to typed values (see
    ``wire.encode_option``) in the order they should appear, or is :func:`prepare`'s.  DhcpError if RFC
    2131 forbids the result."""
    if msg_type not in _ANSWERS:
        raise DhcpError(f"a server replies with OFFER, ACK or NAK, not {msg_type!r}")
    msg_type = MessageType(msg_type)
    if request.op != BOOTREQUEST:
        raise DhcpError(f"cannot reply to a BOOTREPLY (op {request.op}): servers answer requests only")
    if request.msg_type not in _ANSWERS[msg_type]:
        allowed = " or ".join(sorted(t.name for t in _ANSWERS[msg_type]))
        raise DhcpError(f"a {msg_type.name} answers a {allowed}, not a {request.msg_type.name}")
    inform = request.msg_type == MessageType.INFORM
    nak = msg_type == MessageType.NAK
    yiaddr, siaddr = as_ip(yiaddr, "yiaddr"), as_ip(siaddr, "siaddr")
    wants_address = not (nak or inform)
    if wants_address and yiaddr == ZERO:
        raise DhcpError(f"a {msg_type.name} to a {request.msg_type.name} must carry the address in yiaddr")
    if not wants_address and yiaddr != ZERO:
        raise DhcpError(f"yiaddr must be 0 in a {msg_type.name} to a {request.msg_type.name} (RFC 2131 Table 3)")
    if nak and (siaddr != ZERO or sname or file):
        raise DhcpError("a NAK carries no siaddr, sname or file (RFC 2131 Table 3)")

    prepared = options if isinstance(options, Options) else prepare(options or {})
    if nak and not prepared.nak_ok:
        bad = next(code for code in prepared.encoded if code not in _NAK_MAY)
        raise DhcpError(f"{option_name(bad)} may not appear in a NAK: only a message (56) and vendor "
                        "class (60) may (RFC 2131 Table 3)")
    if wants_address and not prepared.has_lease:
        raise DhcpError(f"a {msg_type.name} to a {request.msg_type.name} must carry the lease time (option 51)")
    if inform and prepared.has_lease:
        raise DhcpError("an ACK to an INFORM must not carry a lease time (RFC 2131 §4.3.5)")

    opts = {Opt.MSG_TYPE: bytes((msg_type,)), Opt.SERVER_ID: _encoded(Opt.SERVER_ID, server_id), **prepared.encoded}
    if request.client_id is not None:
        opts[Opt.CLIENT_ID] = request.client_id  # RFC 6842
    flags = request.flags | (FLAG_BROADCAST if nak and request.giaddr != ZERO else 0)
    ciaddr = request.ciaddr if msg_type == MessageType.ACK else ZERO
    if sname or file:
        return Message(op=BOOTREPLY, xid=request.xid, chaddr=request.chaddr, options=opts, htype=request.htype,
                       flags=flags, ciaddr=ciaddr, yiaddr=yiaddr, siaddr=siaddr, giaddr=request.giaddr,
                       sname=sname, file=file)
    # Every field is checked already: the request's by its own construction, the options by encode_option,
    # the addresses by as_ip (Message._checked_already says why this matters).
    return Message._checked_already(BOOTREPLY, request.xid, request.chaddr, opts, request.htype, 0, 0, flags, ciaddr,
                                    yiaddr, siaddr, request.giaddr, b"", b"")


def destination(request: Message, reply_msg: Message, relay_mac: bytes | None = None) -> Destination:
    """RFC 2131 §4.1: the (IP, MAC, UDP port) a reply to ``request`` is sent to."""
    if request.giaddr != ZERO:
        return Destination(request.giaddr, relay_mac, SERVER_PORT)
    eth = request.htype == HTYPE_ETHERNET and len(request.chaddr) == 6
    broadcast = Destination(BROADCAST_IP, BROADCAST_MAC, CLIENT_PORT)
    if reply_msg.msg_type == MessageType.NAK:
        return broadcast
    if request.ciaddr != ZERO:
        return Destination(request.ciaddr, request.chaddr if eth else None, CLIENT_PORT)
    if request.broadcast or not eth or reply_msg.yiaddr == ZERO:
        return broadcast
    return Destination(reply_msg.yiaddr, request.chaddr, CLIENT_PORT)


def reply_limit(request: Message, mtu: int = LINK_MTU) -> int:
    """Largest DHCP message (UDP payload) to send in reply: for ``Message.serialize(max_size=...)``."""
    datagram = max(MIN_DATAGRAM, request.max_message_size or MIN_DATAGRAM)
    return min(datagram, mtu) - IP_UDP_HEADERS
