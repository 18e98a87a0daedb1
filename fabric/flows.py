"""Switch-neutral flow and group specs: what the compiler emits and the controller installs.

A ``FlowSpec`` is identified on a switch by ``(table, priority, match)``; its
``cookie`` names what it is for::

    bits 63..56  kind      (Kind below)
    bits 55..40  service id (0 for fabric-wide flows)
    bits 39..16  range lo   (or port number for port-security drops)
    bits 15..0   epoch      (low 16 bits of the range's epoch)

Matches are tuples of ``(field, value, mask|None)`` sorted by field, values as
ints (MACs as 48-bit ints); a mask equal to all ones is dropped and the value
is pre-masked, so two equal matches compare equal however they were written.
Actions are tuples: ``("output", port)``, ``("set_eth_dst", mac_int)``,
``("group", gid)``, ``("goto", table)``, ``("normal",)``, ``("controller",)``,
``("flood",)``, ``("in_port",)`` (back out of the port the frame came in on: OpenFlow's IN_PORT),
``("move", src_field, src_ofs, dst_field, dst_ofs, n_bits)``
(copy ``n_bits`` bits of one header field into another, bit 0 = the field's
least significant bit: OVS's Nicira ``move``; build it with ``move()``),
``("multipath", "eth_src", basis, n_links, dst_field, dst_ofs, n_bits)`` (OVS's
Nicira ``multipath``, algorithm ``modulo_n``: the hash of the source MAC modulo
``n_links`` into ``n_bits`` bits of a field; build it with ``multipath()``); an
empty action tuple drops.
"""

from __future__ import annotations

import contextlib
import enum
import gc
from dataclasses import dataclass, field
from typing import Iterator

FIELD_BITS = {"in_port": 32, "eth_dst": 48, "eth_src": 48, "eth_type": 16, "ip_proto": 8,
              "ipv4_src": 32, "ipv4_dst": 32, "udp_dst": 16, "udp_src": 16}
# OVS's NXM_NX_IP_FRAG (its nw_frag): bit 0 "a fragment", bit 1 "a later fragment" (no L4 header).
FIELD_BITS["ip_frag"] = 8
FRAG_ANY, FRAG_LATER = 0x01, 0x02
# Header fields a ``move`` may read or write (no in_port: it is metadata, not a header).
MOVE_FIELDS = ("eth_dst", "eth_src", "ipv4_src", "ipv4_dst")
TABLE_ADMIT = 0
TABLE_ROUTE = 1


class Kind(enum.IntEnum):
    BASE = 1        # table-miss / NORMAL
    ADMIT = 2       # port security: allowed sources
    DENY = 3        # port security: drop (counted)
    FRONTDOOR = 4   # protocol → VID classifiers
    VID_ROUTE = 5   # masked VID → owner
    HOST_ROUTE = 6  # plain MAC → host
    VID_MISS = 7    # VID of no live range
    GUARD = 8       # a front door's server answers from a port with no server of it: drop (counted)
    SPOOF = 9       # a front door's request from an IPv4 source its host is not registered with: drop (counted)
    REMOTE = 10     # masked VID prefix → the tunnel to the node owning those keys (fabric/tworoute.py)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold Python's cyclic GC while building or reading hundreds of thousands of flows.

    Specs are acyclic (reference counting frees them); without this, repeated
    full collections over the growing heap cost three times the work itself.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def make_cookie(kind: Kind, service: int = 0, lo: int = 0, epoch: int = 0) -> int:
    return (int(kind) << 56) | ((service & 0xFFFF) << 40) | ((lo & 0xFFFFFF) << 16) | (epoch & 0xFFFF)


def split_cookie(cookie: int) -> tuple[int, int, int, int]:
    """(kind, service, lo, epoch)"""
    return cookie >> 56, (cookie >> 40) & 0xFFFF, (cookie >> 16) & 0xFFFFFF, cookie & 0xFFFF


Match = tuple[tuple[str, int, "int | None"], ...]


def match(**fields: int | tuple[int, int]) -> Match:
    """Canonical match from keyword fields; a tuple value is (value, mask)."""
    out = []
    for name, spec in fields.items():
        if name not in FIELD_BITS:
            raise ValueError(f"unsupported match field {name!r}")
        full = (1 << FIELD_BITS[name]) - 1
        value, mask = spec if isinstance(spec, tuple) else (spec, full)
        if mask == 0:
            continue
        out.append((name, value & mask, None if mask == full else mask))
    return tuple(sorted(out))


def move(src: str, src_ofs: int, dst: str, dst_ofs: int, n_bits: int) -> tuple:
    """The ``move`` action, checked: both bit ranges must lie inside their fields."""
    for name, ofs in ((src, src_ofs), (dst, dst_ofs)):
        if name not in MOVE_FIELDS:
            raise ValueError(f"move: field {name!r} is not movable: use one of {', '.join(MOVE_FIELDS)}")
        if not (isinstance(ofs, int) and isinstance(n_bits, int) and ofs >= 0 and n_bits >= 1
                and ofs + n_bits <= FIELD_BITS[name]):
            raise ValueError(f"move: bits {ofs}..{ofs + n_bits - 1} are outside {name} "
                             f"({FIELD_BITS[name]} bits: 0..{FIELD_BITS[name] - 1})")
    return ("move", src, src_ofs, dst, dst_ofs, n_bits)


def multipath(src: str, basis: int, n_links: int, dst: str, dst_ofs: int) -> tuple:
    """The ``multipath`` action (fields ``eth_src``, algorithm ``modulo_n``), checked: ``n_links`` a power of two
    in 2..65536 (OVS's limit), its bits inside ``dst``."""
    if src != "eth_src":
        raise ValueError(f"multipath: only eth_src can be hashed (OVS's eth_src fields), not {src!r}")
    if not (isinstance(n_links, int) and 2 <= n_links <= 1 << 16 and n_links & (n_links - 1) == 0):
        raise ValueError(f"multipath: n_links {n_links!r} must be a power of two in 2..65536")
    if not (isinstance(basis, int) and 0 <= basis <= 0xFFFF):
        raise ValueError(f"multipath: basis {basis!r} must be in 0..65535")
    n_bits = n_links.bit_length() - 1
    move(dst, dst_ofs, dst, dst_ofs, n_bits)  # the same bounds check as a move's
    return ("multipath", src, basis, n_links, dst, dst_ofs, n_bits)


@dataclass(frozen=True)
class FlowSpec:
    table: int
    priority: int
    match: Match
    actions: tuple = ()
    cookie: int = 0

    @property
    def key(self) -> tuple[int, int, Match]:
        return (self.table, self.priority, self.match)


@dataclass(frozen=True)
class Bucket:
    weight: int
    actions: tuple


@dataclass(frozen=True)
class GroupSpec:
    group_id: int
    type: str  # "all" | "select"
    buckets: tuple[Bucket, ...]


@dataclass
class SwitchConfig:
    """Everything one switch should hold."""

    dpid: int
    flows: dict = field(default_factory=dict)   # key -> FlowSpec
    groups: dict = field(default_factory=dict)  # group_id -> GroupSpec

    def add(self, flow: FlowSpec) -> None:
        self.flows[flow.key] = flow
