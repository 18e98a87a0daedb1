"""How DHCP and ARP frames meet the stateful-endpoint loop: the only module that knows these two formats.

The loop (``vfab.vid.state.loop``) reads vfab frames (EtherType 0x88B5) and
holds, forwards and replicates their payloads unparsed.  The dhcp4 front door
delivers plain Ethernet/IPv4/UDP frames instead, so a shard's port
(``port.py``) wraps each DHCP frame it receives into a vfab REQUEST frame
whose payload is this **request** (everything a shard needs to serve it, on
whichever shard it ends up after a forward or a hold)::

    version u8 (1) | Ethernet source (6 B) | flags u8 (bit 0: sent to an IP broadcast) | DHCP message

The IPv4 and UDP headers are checked (checksums, no fragments, UDP 68 or 67 →
67) by ``ipudp`` before the wrap and not kept: replies are addressed by RFC
2131 §4.1 (``reply.destination``) from the DHCP message and the Ethernet source
(the relay's MAC for a relayed request).

ARP (RFC 826, Ethernet/IPv4 only): clients resolve the virtual server address
before a unicast renewal; the shard owning the asking MAC's key answers
(``server.py``).  :func:`parse_arp_request` and :func:`arp_reply` are the two
halves.
"""

from __future__ import annotations

import struct

from vfab.services.sdhcp import ipudp
from vfab.services.sdhcp.errors import DhcpError
from vfab.vid.frame import MAX_PAYLOAD, Frame, FrameType

VERSION = 1
REQ = struct.Struct("!B6sB")
FLAG_IP_BROADCAST = 1
ETH_P_ARP = 0x0806
ARP = struct.Struct("!HHBBH6s4s6s4s")
ARP_REQUEST, ARP_REPLY = 1, 2
SERVER_PORT, CLIENT_PORT = 67, 68
BROADCAST_IP = b"\xff" * 4


def wrap(raw: bytes, port_mac: bytes) -> bytes:
    """The vfab REQUEST frame (bytes) carrying the DHCP frame ``raw``; DhcpError says why it is not one."""
    dg = ipudp.parse(raw)
    if dg.dst_port != SERVER_PORT or dg.src_port not in (CLIENT_PORT, SERVER_PORT):
        raise DhcpError(f"UDP {dg.src_port} -> {dg.dst_port} is not DHCP to a server (68 or 67 -> 67)")
    payload = REQ.pack(VERSION, dg.eth_src, FLAG_IP_BROADCAST if dg.dst_ip.packed == BROADCAST_IP else 0) \
        + dg.payload
    if len(payload) > MAX_PAYLOAD:
        raise DhcpError(f"DHCP message of {len(dg.payload)} B is too large: the limit is "
                        f"{MAX_PAYLOAD - REQ.size} B (one 1500 B frame)")
    return Frame(dst=port_mac, src=dg.eth_src, type=FrameType.REQUEST, payload=payload).serialize()


def unwrap(payload: bytes) -> tuple[bytes, bool, bytes]:
    """(Ethernet source, sent to an IP broadcast, DHCP message) of a request; DhcpError if malformed."""
    if len(payload) < REQ.size or payload[0] != VERSION:
        raise DhcpError(f"not an sdhcp request ({len(payload)} B, version {payload[:1].hex() or '-'}): "
                        "requests reach a shard through the dhcp4 front door")
    _, src, flags = REQ.unpack_from(payload)
    return bytes(src), bool(flags & FLAG_IP_BROADCAST), bytes(payload[REQ.size:])


def request(eth_src: bytes, dhcp: bytes, broadcast: bool = True) -> bytes:
    """A request payload as :func:`wrap` makes it (tests, tools)."""
    return REQ.pack(VERSION, eth_src, FLAG_IP_BROADCAST if broadcast else 0) + dhcp


def parse_arp_request(raw: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(sender MAC, sender IPv4, target IPv4) of an Ethernet/IPv4 ARP request, else None.

    The sender MAC must be the frame's Ethernet source (a host speaks for its own MAC only)."""
    if len(raw) < 14 + ARP.size or raw[12:14] != ETH_P_ARP.to_bytes(2, "big"):
        return None
    htype, ptype, hlen, plen, op, sha, spa, _tha, tpa = ARP.unpack_from(raw, 14)
    if (htype, ptype, hlen, plen, op) != (1, ipudp.ETH_P_IP, 6, 4, ARP_REQUEST) or sha != raw[6:12]:
        return None
    return bytes(sha), bytes(spa), bytes(tpa)


def arp_reply(src_mac: bytes, ip: bytes, to_mac: bytes, to_ip: bytes) -> bytes:
    """``ip`` is at ``src_mac``: the ARP reply frame to ``to_mac``/``to_ip`` (padded to 60 B)."""
    frame = to_mac + src_mac + ETH_P_ARP.to_bytes(2, "big") + ARP.pack(
        1, ipudp.ETH_P_IP, 6, 4, ARP_REPLY, src_mac, ip, to_mac, to_ip)
    return frame.ljust(60, b"\0")
