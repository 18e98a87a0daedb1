"""Ethernet + IPv4 + UDP framing of DHCP on a raw socket: the only module that knows these headers.

::

    Ethernet (14 B)   dst MAC (6) | src MAC (6) | EtherType 0x0800
    IPv4 (20 B sent; options accepted on receive, RFC 791)
     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-------+-------+---------------+-------------------------------+
    |Ver=4  |IHL>=5 |   DSCP/ECN    |          total length         |
    +-------+-------+---------------+-----+-------------------------+
    |        identification         |flags|     fragment offset     |
    +---------------+---------------+-----+-------------------------+
    |      TTL      | protocol = 17 |        header checksum        |
    +---------------+---------------+-------------------------------+
    |                         source address                        |
    +---------------------------------------------------------------+
    |                      destination address                      |
    +-------------------------------+-------------------------------+
    UDP (8 B, RFC 768)
    |          source port          |       destination port        |
    +-------------------------------+-------------------------------+
    |     length (8 + payload)      |  checksum (over pseudo-header)|
    +-------------------------------+-------------------------------+
    |                  payload: one DHCP message ...                |

Checksums are the Internet checksum (RFC 1071): the IP one over the IP
header, the UDP one over the pseudo-header (source, destination, 0, 17, UDP
length), the UDP header and the payload; a received 0 means "none".  A computed
UDP checksum of 0 is sent as 0 ("none", which RFC 768 allows over IPv4), not as
the 0xFFFF RFC 768 asks for: busybox udhcpc and dhcpcd compare the field with
the value they compute (0) and drop the reply, so a client whose xid made its
OFFER sum to that (1 in 65,535) never got a lease (seen in the lease bench,
2026-11-29; tests/unit/test_dhcp_clients.py); every receiver skips a 0.
:func:`parse` drops IP fragments (DHCP is never fragmented and a raw socket
gets no reassembly) and Ethernet padding.  Frames sent by a namespace's own kernel through a veth may carry a partial
UDP checksum (TESTBED-NOTES: ``ethtool -K IF tx off`` in that namespace fixes
it); ``parse(frame, verify=False)`` reads such frames anyway.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from ipaddress import IPv4Address

from vfab.services.sdhcp.errors import DhcpError

ETH = struct.Struct("!6s6sH")
IPV4 = struct.Struct("!BBHHHBBH4s4s")
UDP = struct.Struct("!HHHH")
ETH_P_IP = 0x0800
IPPROTO_UDP = 17
MIN_LEN = ETH.size + IPV4.size + UDP.size  # 42 B
MAX_PAYLOAD = 0xFFFF - IPV4.size - UDP.size
IP_MF = 0x2000
IP_OFFSET = 0x1FFF
DEFAULT_TTL = 64


def checksum(data: bytes) -> int:
    """The Internet checksum of ``data`` (RFC 1071): one's complement of the one's complement sum.

    Computed without a loop: the bytes read as one big-endian number N are sum(word_i * 2**(16*k_i)), and
    2**16 = 1 modulo 0xFFFF, so the folded 16-bit sum is N mod 0xFFFF, except that a non-zero sum that is
    a multiple of 0xFFFF folds to 0xFFFF, not 0 (RFC 1071 §2: end-around carry)."""
    if len(data) % 2:
        data += b"\0"
    n = int.from_bytes(data, "big")
    total = n % 0xFFFF
    if total == 0 and n:
        total = 0xFFFF
    return ~total & 0xFFFF


def _pseudo(src: bytes, dst: bytes, udp_len: int) -> bytes:
    return src + dst + struct.pack("!BBH", 0, IPPROTO_UDP, udp_len)


@dataclass(frozen=True)
class Datagram:
    """One UDP datagram in one Ethernet frame."""

    eth_dst: bytes
    eth_src: bytes
    src_ip: IPv4Address
    dst_ip: IPv4Address
    src_port: int
    dst_port: int
    payload: bytes
    ttl: int = DEFAULT_TTL
    ident: int = 0
    tos: int = 0

    def serialize(self) -> bytes:
        for name, mac in (("eth_dst", self.eth_dst), ("eth_src", self.eth_src)):
            if not isinstance(mac, (bytes, bytearray)) or len(mac) != 6:
                raise DhcpError(f"{name} {mac!r} is not a 6-byte MAC")
        for name, value, bits in (("src_port", self.src_port, 16), ("dst_port", self.dst_port, 16),
                                  ("ttl", self.ttl, 8), ("ident", self.ident, 16), ("tos", self.tos, 8)):
            if not isinstance(value, int) or value < 0 or value >> bits:
                raise DhcpError(f"{name} {value!r} is out of range: it is an unsigned {bits}-bit field")
        if len(self.payload) > MAX_PAYLOAD:
            raise DhcpError(f"payload of {len(self.payload)} B does not fit one IPv4 datagram "
                            f"(limit {MAX_PAYLOAD} B)")
        try:
            src, dst = _packed(self.src_ip), _packed(self.dst_ip)
        except ValueError:
            raise DhcpError(f"{self.src_ip!r} -> {self.dst_ip!r}: both must be IPv4 addresses") from None
        return udp_frame(self.eth_dst, self.eth_src, src, dst, self.src_port, self.dst_port, self.payload, self.ttl,
                         self.ident, self.tos)

    @classmethod
    def _checked_already(cls, eth_dst: bytes, eth_src: bytes, src_ip: IPv4Address, dst_ip: IPv4Address,
                         src_port: int, dst_port: int, payload: bytes, ttl: int, ident: int, tos: int) -> "Datagram":
        """A Datagram of fields :func:`parse` read from a frame (each in range by its size): without the
        frozen dataclass's ten ``object.__setattr__`` calls, one per field, on every frame a shard receives."""
        d = object.__new__(cls)
        d.__dict__.update(eth_dst=eth_dst, eth_src=eth_src, src_ip=src_ip, dst_ip=dst_ip, src_port=src_port,
                          dst_port=dst_port, payload=payload, ttl=ttl, ident=ident, tos=tos)
        return d


def udp_frame(eth_dst: bytes, eth_src: bytes, src: bytes, dst: bytes, src_port: int, dst_port: int, payload: bytes,
              ttl: int = DEFAULT_TTL, ident: int = 0, tos: int = 0) -> bytes:
    """The Ethernet frame of one UDP datagram, both checksums computed, from fields already in range
    (``Datagram.serialize`` checks them; a server's replies, built from checked parts, come here directly).
    ``src`` and ``dst`` are packed IPv4 addresses (4 B)."""
    udp_len = UDP.size + len(payload)
    ip = IPV4.pack(0x45, tos, IPV4.size + udp_len, ident, 0, ttl, IPPROTO_UDP, 0, src, dst)
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    udp = UDP.pack(src_port, dst_port, udp_len, 0) + bytes(payload)
    csum = checksum(_pseudo(src, dst, udp_len) + udp)   # 0 stays 0 ("none"): see the module's docstring
    return ETH.pack(eth_dst, eth_src, ETH_P_IP) + ip + udp[:6] + struct.pack("!H", csum) + udp[8:]


def _packed(ip) -> bytes:
    # IPv4Address(an IPv4Address) converts through the text form: skip it on every reply
    return ip.packed if isinstance(ip, IPv4Address) else IPv4Address(ip).packed


def parse(frame: bytes, verify: bool = True) -> Datagram:
    """Parse an Ethernet frame carrying IPv4/UDP.  Raises DhcpError, and nothing else, for any other
    frame; ``verify=False`` skips both checksums (for kernel frames with offloaded checksums)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise DhcpError(f"parse() takes an Ethernet frame as bytes, not {type(frame).__name__}")
    frame = bytes(frame)
    if len(frame) < MIN_LEN:
        raise DhcpError(f"frame of {len(frame)} B is too short for Ethernet+IPv4+UDP ({MIN_LEN} B)")
    eth_dst, eth_src, eth_type = ETH.unpack_from(frame)
    if eth_type != ETH_P_IP:
        raise DhcpError(f"EtherType {eth_type:#06x} is not IPv4 (0x0800)")
    vihl, tos, total, ident, frag, ttl, proto, _, src, dst = IPV4.unpack_from(frame, ETH.size)
    ihl = (vihl & 0x0F) * 4
    if vihl >> 4 != 4:
        raise DhcpError(f"IP version {vihl >> 4} is not 4")
    if ihl < IPV4.size:
        raise DhcpError(f"IPv4 header length {ihl} B is below the minimum of {IPV4.size} B")
    if total < ihl + UDP.size or ETH.size + total > len(frame):
        raise DhcpError(f"IPv4 total length {total} B does not fit: header {ihl} B + UDP 8 B, frame carries "
                        f"{len(frame) - ETH.size} B after Ethernet")
    if frag & (IP_MF | IP_OFFSET):
        raise DhcpError("IPv4 fragment: DHCP messages are never fragmented and a raw socket does not reassemble")
    if proto != IPPROTO_UDP:
        raise DhcpError(f"IP protocol {proto} is not UDP (17)")
    ip_end = ETH.size + total
    if verify and checksum(frame[ETH.size:ETH.size + ihl]) != 0:
        raise DhcpError("bad IPv4 header checksum")
    udp_off = ETH.size + ihl
    sport, dport, udp_len, udp_csum = UDP.unpack_from(frame, udp_off)
    if udp_len < UDP.size or udp_off + udp_len > ip_end:
        raise DhcpError(f"UDP length {udp_len} B does not fit the {total - ihl} B of the IP payload")
    udp = frame[udp_off:udp_off + udp_len]
    if verify and udp_csum and checksum(_pseudo(src, dst, udp_len) + udp) != 0:
        raise DhcpError("bad UDP checksum (a kernel sender behind checksum offload? see ethtool -K IF tx off)")
    return Datagram._checked_already(eth_dst, eth_src, IPv4Address(src), IPv4Address(dst), sport, dport,
                                     udp[UDP.size:], ttl, ident, tos)
