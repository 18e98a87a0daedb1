"""The 24-bit VID key of a client MAC: the one function the switch and the service both compute.

A front door that keys a service by the client's MAC (sdhcp's ``dhcp4``) derives
the key in the switch; every decision of the service that depends on the key
(which shard owns a client, which VID a reply leaves from, where a lease row
lives, which shard a relayed request goes to) must compute the very same
value.  This module is that value, named by a **key function**:

``mac-low24`` (legacy)   key = the MAC's low 24 bits (one ``move``).
``mac-hash``             key bits 23..8 = OVS ``multipath(eth_src, basis 0, modulo_n, 65536 links)``,
                         i.e. Bob Jenkins' lookup3 hash of the 6 MAC bytes (OVS ``jhash_bytes``,
                         words read little-endian) mod 2**16; key bits 7..0 = the MAC's low byte (a ``move``).

Why ``mac-hash``, and why so:

* **Robust to any clustering.** Vendors, Docker (``02:42:ac:11:00:xx``), perfdhcp and test rigs number MACs in
  sequence, or in strides (256 apart, one per rack, ...).  The low 24 bits put 1,000 sequential MACs below
  0x400000 (one shard of four).  Every bit of all 48 MAC bits enters the hash, so sequential MACs, strides
  and MACs differing only in their OUI spread as evenly as random ones.  A bijective bit permutation (``move``
  bit by bit: bit reversal and the like) cannot: each key bit is one MAC bit, so the top key bits that pick
  the shard are fixed MAC bits, and some clustering pattern (a stride that leaves exactly those bits alone,
  or too few clients to reach them) puts everyone in one shard.
* **Collisions.** Keys are not identities (leases are keyed by chaddr), so a shared key costs nothing but
  balance.  With the low byte kept as is, MACs within one aligned block of 256 (the common sequential case)
  never share a key; other MACs share one with probability 2**-24.
* **Cost per packet.** OVS runs ``multipath`` when it translates the flow (an upcall), not per packet: the
  door flow matches ``eth_src`` exactly anyway (port security), so the cached datapath flow carries the
  computed ``eth_dst`` and later packets of the client pay nothing.  It works with the kernel and the
  userspace datapath alike (it is ovs-vswitchd's translation).  ``multipath`` writes at most 16 bits
  (65,536 links): the low 8 come from the MAC by a ``move``.
* **Both sides compute it.** ``multipath``'s ``modulo_n`` is ``hash % n_links``, and OVS's ``eth_src`` hash is
  ``jhash_bytes(dl_src, 6, basis)`` (lib/flow.c ``flow_hash_fields``): a public, fixed algorithm that Python
  (here) and C (``services/sdhcp/native/sdhcp_lane.c``) reproduce bit for bit; the integration test
  ``tests/integration/test_mackey_ovs.py`` checks it against the host's OVS with ``ofproto/trace``.  (OVS reads
  the hashed words in host byte order; this is the little-endian value, what x86 and arm64 switches compute.)
  The alternatives fail here: a ``select`` group picks one bucket (2**24 buckets are out of the question) by a
  datapath hash (``dp_hash``) nobody outside the datapath can reproduce; ``bundle`` loads a port number, not a key.
"""

from __future__ import annotations

from vfab.vid.codec import KEY_MAX

LOW24 = "mac-low24"
HASH = "mac-hash"
FUNCTIONS = (HASH, LOW24)
LEGACY = LOW24            # what a front door record that names no key function means (written before mac-hash)
BASIS = 0                 # multipath's basis
HASH_BITS = 16            # multipath's links: 2**16, written to key bits 8..23
LOW_BITS = 8              # the MAC's low byte, moved to key bits 0..7
_M = 0xFFFFFFFF


class KeyFunctionError(ValueError):
    """An unknown key function name."""


def check(name: str) -> str:
    if name not in FUNCTIONS:
        raise KeyFunctionError(f"key function {name!r} is unknown: use {HASH} (sequential MACs spread) or "
                               f"{LOW24} (the MAC's low 24 bits, as before)")
    return name


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = (a - c) & _M; a ^= _rot(c, 4); c = (c + b) & _M          # noqa: E702
    b = (b - a) & _M; b ^= _rot(a, 6); a = (a + c) & _M          # noqa: E702
    c = (c - b) & _M; c ^= _rot(b, 8); b = (b + a) & _M          # noqa: E702
    a = (a - c) & _M; a ^= _rot(c, 16); c = (c + b) & _M         # noqa: E702
    b = (b - a) & _M; b ^= _rot(a, 19); a = (a + c) & _M         # noqa: E702
    c = (c - b) & _M; c ^= _rot(b, 4); b = (b + a) & _M          # noqa: E702
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c ^= b; c = (c - _rot(b, 14)) & _M                           # noqa: E702
    a ^= c; a = (a - _rot(c, 11)) & _M                           # noqa: E702
    b ^= a; b = (b - _rot(a, 25)) & _M                           # noqa: E702
    c ^= b; c = (c - _rot(b, 16)) & _M                           # noqa: E702
    a ^= c; a = (a - _rot(c, 4)) & _M                            # noqa: E702
    b ^= a; b = (b - _rot(a, 14)) & _M                           # noqa: E702
    c ^= b; c = (c - _rot(b, 24)) & _M                           # noqa: E702
    return c


def jhash_bytes(data: bytes, basis: int = 0) -> int:
    """lookup3's hash of ``data`` as OVS's ``jhash_bytes`` computes it on a little-endian host."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n + basis) & _M
    p = 0
    while n - p >= 12:
        a = (a + int.from_bytes(data[p:p + 4], "little")) & _M
        b = (b + int.from_bytes(data[p + 4:p + 8], "little")) & _M
        c = (c + int.from_bytes(data[p + 8:p + 12], "little")) & _M
        a, b, c = _mix(a, b, c)
        p += 12
    if p < n:
        tail = data[p:] + bytes(12 - (n - p))
        a = (a + int.from_bytes(tail[0:4], "little")) & _M
        b = (b + int.from_bytes(tail[4:8], "little")) & _M
        c = (c + int.from_bytes(tail[8:12], "little")) & _M
        c = _final(a, b, c)
    return c


def key(mac: bytes | int, fn: str = HASH) -> int:
    """The VID key of ``mac`` (6 bytes, or a 48-bit int) under key function ``fn``."""
    if isinstance(mac, int):
        mac = mac.to_bytes(6, "big")
    if fn == HASH:
        return (jhash_bytes(bytes(mac), BASIS) % (1 << HASH_BITS)) << LOW_BITS | mac[5]
    check(fn)
    return int.from_bytes(mac[3:6], "big")


def keyer(fn: str):
    """``key`` bound to ``fn`` (checked once)."""
    check(fn)
    if fn == LOW24:
        return lambda mac: (int.from_bytes(mac, "big") if not isinstance(mac, int) else mac) & KEY_MAX
    return lambda mac: key(mac, HASH)


def of_service(svc) -> str:
    """The key function of a service record's MAC-keyed (dhcp4) front door; LEGACY if it names none."""
    for door in getattr(svc, "frontdoors", None) or []:
        if isinstance(door, dict) and door.get("kind") == "dhcp4":
            return door.get("key", LEGACY)
    return LEGACY
