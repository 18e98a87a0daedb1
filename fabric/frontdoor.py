"""Front doors: table-0 classifiers that turn a real protocol into a service's VIDs (DESIGN.md §3).

A service opts in through its record's ``frontdoors`` list; each entry is an
object with a ``"kind"`` and scalar parameters::

    {"kind": "dhcp4"}
    {"kind": "udp", "ip": "10.0.0.100", "port": 11211, "key": "ip_src"}

Every kind is registered here with its parameters (type, required or default,
check).  An entry naming an unknown kind, missing a parameter, carrying an
unknown one or a bad value is a ``FrontDoorError``; so is a door whose frames
another service's door already claims.  The compiler records the error in
``FabricState.problems`` and skips that door, never the fabric.

A door compiles to one flow per registered host (its port and MAC; never a
trunk: a frame that crossed a trunk was classified at its ingress switch), in
table 0 at the priority the compiler reserves (400), cookie kind FRONTDOOR::

    match    in_port=P, eth_src=<that host's own MAC>, <the kind's protocol match>
    actions  set eth_dst = VID(service, key 0)              (vfab.vid.codec)
             move <key source>[0..23] -> eth_dst[<key bits>] (Nicira move)
               (dhcp4 with key mac-hash instead: multipath(eth_src) -> key bits 8..23,
                move eth_src[0..7] -> key bits 0..7; see vfab.vid.mackey)
             goto table 1                                  (normal VID routing)

Matching ``eth_src`` keeps port security: a host speaks only for its own MAC,
a forged source falls through to the port's deny flow.

A door also guards its protocol's **answers**: a kind names the frames its
servers answer with (DHCP: ``udp, udp_src=67, udp_dst=68``; udp: ``udp,
ipv4_src=ip, udp_src=port``), and on every registered host port that carries
no live endpoint of the service (its servers, helpers included) such frames are
dropped and counted, in table 0 above the doors (450), cookie kind GUARD::

    match    in_port=P, <the kind's answer match>
    actions  (none: drop)

Without it a tenant's rogue DHCP server, or a host forging memcached's
address and port, reached the clients through the plain-Ethernet flows
(NORMAL): the clients cannot tell.  A ``udp`` door also guards the request's
**source address**: a host registered with its IPv4 addresses (``Host.ips``)
reaches the door only from them; its requests from any other address are
dropped at its port (just below the door, 399, cookie kind SPOOF, counted),
else the service's replies (memcached's, a helper's) would go to whoever owns
that address: UDP reflection, memcached's multi-gets an amplifier.  A host
registered without addresses (DHCP clients) is not source-guarded.  (A DHCP server's answer to a relay,
67 → 67, looks like a relay's request: the dhcp4 door takes it into the
service like every datagram to port 67 from a host port, and the shard drops
it as the wrong op, so a tenant's answers reach no relay either.)  Where the key sits in
the MAC comes from the codec: the prefix layout's key is the MAC's low 24 bits,
the suffix layout's bits 16..39; both layouts work.

Kinds:

- ``dhcp4``: ``udp, udp_dst=67``; ``key`` (the key function of the client MAC
  ``eth_src``, ``vfab.vid.mackey``): ``mac-hash`` (what ``vfab service add --kind
  sdhcp`` writes: OVS ``multipath`` hashes the MAC into key bits 8..23, a ``move``
  puts its low byte in bits 0..7, so sequential MACs spread over the key space)
  or ``mac-low24`` (the MAC's low 24 bits; what a record naming no ``key`` means,
  as every record did before ``mac-hash``).
- ``udp``: ``ip`` (IPv4 address, required), ``port`` (1..65535, required),
  ``key`` (``ip_src`` (default): the low 24 bits of the client's IPv4 source
  address, or ``eth_src``): ``udp, ipv4_dst=ip, udp_dst=port``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from vfab.fabric.flows import FRAG_ANY, TABLE_ADMIT, TABLE_ROUTE, FlowSpec, Kind, make_cookie, match, move, multipath
from vfab.vid import codec, mackey
from vfab.vid.errors import VidError

ETH_IPV4 = 0x0800
IPPROTO_UDP = 17
DHCP_SERVER_PORT = 67
DHCP_CLIENT_PORT = 68


class FrontDoorError(VidError):
    """A front-door entry that cannot be compiled: unknown kind, bad parameter, clash."""


@dataclass(frozen=True)
class Param:
    """One parameter of a kind: ``check`` turns the raw value into the normalized one or raises ValueError."""

    check: Callable[[Any], Any]
    required: bool = True
    default: Any = None
    help: str = ""


@dataclass(frozen=True)
class Door:
    """A validated front door of one service."""

    service: str
    index: int                 # position in the service's list (names it in errors and its cookie)
    kind: str
    protocol: tuple            # match fields beyond in_port/eth_src, as (name, value) pairs
    key_field: str             # where the 24-bit key comes from (bits 0..23)
    params: dict = field(default_factory=dict, compare=False)
    answers: tuple = ()        # match fields of the servers' answers (guarded), as (name, value) pairs
    source_guard: bool = False  # requests only from the sending host's registered IPv4 addresses (if any)
    key_fn: str = mackey.LOW24  # how the key comes from key_field (vfab.vid.mackey)
    fragments: tuple = ()          # match fields of the requests' IP fragments (see fragment_door)
    answer_fragments: tuple = ()   # and of the answers' (guarded like the answers)

    @property
    def label(self) -> str:
        return f"front door #{self.index} ({self.kind}) of service {self.service!r}"

    def fragment_door(self) -> "Door | None":
        """The door's twin for the IP fragments of its requests (None: the kind has none).

        OVS's default fragment handling zeroes the UDP ports of every fragment, the first one too, so a
        ``udp_dst`` door never sees a fragmented request: its fragments went around the door (straight to
        memcached's host by NORMAL) while the same client's small requests went through a helper (issue 43).
        The twin matches every UDP fragment to the door's address (``ip_frag`` = a fragment) and classifies it
        by the same key field, which fragments carry (the source address, the MAC): all of a client's
        datagrams reach the same VID, the same range and the same select group, whose OVS default (dp_hash of
        the symmetric L3/L4 hash, which leaves UDP ports out) then picks one helper per client address.  The
        twin keeps the source guard (fragments from an unregistered address are dropped) and guards the
        answers' fragments as the answers."""
        if not self.fragments:
            return None
        return replace(self, protocol=self.fragments, answers=self.answer_fragments, fragments=(),
                       answer_fragments=())

    def claims(self) -> tuple[int, int | None]:
        """(udp port, IPv4 destination or None = any): which frames the door takes."""
        fields = dict(self.protocol)
        return fields["udp_dst"], fields.get("ipv4_dst")


@dataclass(frozen=True)
class DoorKind:
    name: str
    params: dict[str, Param]
    build: Callable[[str, int, dict], Door]   # (service, index, checked params) -> Door
    help: str = ""


KINDS: dict[str, DoorKind] = {}


def register(kind: DoorKind) -> DoorKind:
    if kind.name in KINDS:
        raise ValueError(f"front-door kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


# -- parameter checks ----------------------------------------------------------------
def _udp_port(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 0xFFFF:
        raise ValueError(f"must be a UDP port, an integer in 1..65535, got {value!r}")
    return value


def _ipv4(value: Any) -> int:
    try:
        addr = ipaddress.IPv4Address(value) if isinstance(value, str) else None
    except ValueError:
        addr = None
    if addr is None:
        raise ValueError(f"must be an IPv4 address written like \"10.0.0.100\", got {value!r}")
    if addr.is_multicast or addr.is_unspecified:
        raise ValueError(f"must be a unicast IPv4 address, got {value!r}")
    return int(addr)


def _one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return value
    return check


def _udp_protocol(port: int, ip: int | None = None) -> tuple:
    proto = [("eth_type", ETH_IPV4), ("ip_proto", IPPROTO_UDP), ("udp_dst", port)]
    if ip is not None:
        proto.append(("ipv4_dst", ip))
    return tuple(proto)


def _udp_fragments(ip: int, side: str = "ipv4_dst") -> tuple:
    """Any IP fragment of UDP to (``side="ipv4_src"``: from) ip: they carry no ports to match."""
    return (("eth_type", ETH_IPV4), ("ip_proto", IPPROTO_UDP), (side, ip), ("ip_frag", (FRAG_ANY, FRAG_ANY)))


def _udp_answers(src_port: int, src_ip: int | None = None, dst_port: int | None = None) -> tuple:
    ans = [("eth_type", ETH_IPV4), ("ip_proto", IPPROTO_UDP), ("udp_src", src_port)]
    if src_ip is not None:
        ans.append(("ipv4_src", src_ip))
    if dst_port is not None:
        ans.append(("udp_dst", dst_port))
    return tuple(ans)


KEY_FIELDS = {"ip_src": "ipv4_src", "eth_src": "eth_src"}  # the udp kind's "key" → the header field

def _key_fn(value: Any) -> str:
    try:
        return mackey.check(value)
    except mackey.KeyFunctionError as exc:
        raise ValueError(str(exc)) from None


register(DoorKind(
    "dhcp4",
    {"key": Param(_key_fn, required=False, default=mackey.LEGACY,
                  help=f"key function of the client MAC: {mackey.HASH} or {mackey.LOW24}")},
    lambda svc, i, p: Door(svc, i, "dhcp4", _udp_protocol(DHCP_SERVER_PORT), "eth_src", p,
                           _udp_answers(DHCP_SERVER_PORT, dst_port=DHCP_CLIENT_PORT), key_fn=p["key"]),
    help="DHCPv4 (udp_dst=67) from host ports; key = the client MAC's key function (mac-hash: hashed, "
         "mac-low24: its low 24 bits); DHCP answers (67 -> 68) only from the service's hosts",
))

register(DoorKind(
    "udp",
    {"ip": Param(_ipv4, help="the service's IPv4 address"),
     "port": Param(_udp_port, help="the service's UDP port"),
     "key": Param(_one_of(*KEY_FIELDS), required=False, default="ip_src",
                  help="client field whose low 24 bits are the key")},
    lambda svc, i, p: Door(svc, i, "udp", _udp_protocol(p["port"], p["ip"]), KEY_FIELDS[p["key"]], p,
                           _udp_answers(p["port"], p["ip"]), source_guard=True,
                           fragments=_udp_fragments(p["ip"]), answer_fragments=_udp_fragments(p["ip"], "ipv4_src")),
    help="UDP to ip:port from host ports; key = low 24 bits of the client's IPv4 source (or MAC); UDP from "
         "ip:port only from the service's hosts; requests only from a host's registered addresses",
))


# -- validation -----------------------------------------------------------------------
def parse(service: str, index: int, entry: Any) -> Door:
    """One entry of a service's ``frontdoors`` list → a Door, or FrontDoorError saying what and how to fix."""
    where = f"front door #{index} of service {service!r}"
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        raise FrontDoorError(f"{where} is {entry!r}: each front door is an object with a \"kind\", "
                             f"one of {', '.join(sorted(KINDS))}")
    kind = KINDS.get(entry["kind"])
    if kind is None:
        raise FrontDoorError(f"{where}: kind {entry['kind']!r} is unknown: known kinds are "
                             f"{', '.join(sorted(KINDS))}")
    given = {k: v for k, v in entry.items() if k != "kind"}
    unknown = sorted(set(given) - set(kind.params))
    if unknown:
        known = ", ".join(sorted(kind.params)) or "none"
        raise FrontDoorError(f"{where} ({kind.name}): unknown parameter(s) {', '.join(map(repr, unknown))}: "
                             f"{kind.name} takes {known}")
    checked = {}
    for name, param in kind.params.items():
        if name not in given:
            if param.required:
                raise FrontDoorError(f"{where} ({kind.name}): parameter {name!r} is missing ({param.help})")
            checked[name] = param.default
            continue
        try:
            checked[name] = param.check(given[name])
        except ValueError as exc:
            raise FrontDoorError(f"{where} ({kind.name}): parameter {name!r} {exc}") from None
    return kind.build(service, index, checked)


def service_doors(svc, problems: list[str]) -> list[Door]:
    """The valid doors of a Service record; each bad one is a line in ``problems`` and is left out."""
    doors = []
    for i, entry in enumerate(getattr(svc, "frontdoors", None) or []):
        try:
            doors.append(parse(svc.name, i, entry))
        except FrontDoorError as exc:
            problems.append(str(exc))
    return doors


def overlap(a: Door, b: Door) -> bool:
    """True if some frame would match both doors (the same port, and the same or an unrestricted address)."""
    (pa, ia), (pb, ib) = a.claims(), b.claims()
    if a.fragments and b.fragments and ia == ib:
        return True   # fragments carry no port: two doors on one address would both claim them
    return pa == pb and (ia is None or ib is None or ia == ib)


# -- flows ------------------------------------------------------------------------------
def key_rewrite(service_id: int, layout: codec.Layout | str, key_field: str,
                key_fn: str = mackey.LOW24) -> tuple[tuple, ...]:
    """Actions turning a frame into a VID of the service whose key is ``key_fn`` of ``key_field``: its low 24
    bits, or (``mac-hash``, a MAC field) ``vfab.vid.mackey``'s hash, which the service computes alike.

    The base VID (key 0) and the key's bit position in the MAC come from the codec,
    so both layouts work and no MAC is built by hand.
    """
    base = codec.encode(service_id, 0, layout=layout).value
    key_ofs = (codec.encode(service_id, 1, layout=layout).value ^ base).bit_length() - 1
    if key_fn == mackey.HASH:
        return (("set_eth_dst", base),
                multipath(key_field, mackey.BASIS, 1 << mackey.HASH_BITS, "eth_dst", key_ofs + mackey.LOW_BITS),
                move(key_field, 0, "eth_dst", key_ofs, mackey.LOW_BITS))
    return (("set_eth_dst", base), move(key_field, 0, "eth_dst", key_ofs, codec.KEY_BITS))


def door_flows(door: Door, service_id: int, layout: codec.Layout | str,
               host_ports: list[tuple[int, int, int]], priority: int,
               sources: dict[int, list[int]] | None = None) -> list[tuple[int, FlowSpec]]:
    """(dpid, flow) for every host port ``(dpid, port, host MAC as int)``.

    ``sources``: guarded host MAC → the IPv4 addresses (ints) it may send from (maybe none yet: a DHCP host
    before its first lease).  A source-guarded door (the udp kind) takes such a host's requests only from those
    addresses, one flow each; below them (``priority - 1``) one flow drops and counts (cookie kind SPOOF) the
    door's requests from any other source address of that MAC.
    Without it, a tenant sending a request from another host's address had the service's replies (memcached's
    multi-get answers: an amplifier) sent to that host."""
    actions = (*key_rewrite(service_id, layout, door.key_field, door.key_fn), ("goto", TABLE_ROUTE))
    cookie = make_cookie(Kind.FRONTDOOR, service_id, lo=door.index)
    proto = dict(door.protocol)
    out = []
    for dpid, port, mac in host_ports:
        ips = (sources or {}).get(mac) if door.source_guard else None
        if ips is None:
            out.append((dpid, FlowSpec(TABLE_ADMIT, priority, match(in_port=port, eth_src=mac, **proto), actions,
                                       cookie)))
            continue
        out += [(dpid, FlowSpec(TABLE_ADMIT, priority, match(in_port=port, eth_src=mac, ipv4_src=ip, **proto),
                                actions, cookie)) for ip in ips]
        out.append((dpid, FlowSpec(TABLE_ADMIT, priority - 1, match(in_port=port, eth_src=mac, **proto), (),
                                   make_cookie(Kind.SPOOF, service_id, lo=port))))
    return out


def guard_flows(door: Door, service_id: int, ports: list[tuple[int, int]], priority: int) -> list[tuple[int, FlowSpec]]:
    """(dpid, drop flow) of the door's answers for every host port ``(dpid, port)`` given (those with no
    server of the service)."""
    if not door.answers:
        return []
    ans = dict(door.answers)
    return [(dpid, FlowSpec(TABLE_ADMIT, priority, match(in_port=port, **ans), (),
                            make_cookie(Kind.GUARD, service_id, lo=port)))
            for dpid, port in ports]
